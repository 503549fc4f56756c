"""Data: the plan (which samples each step trains on), Parquet streamed by row group, the
sources that turn sample ids into micro-batches, and the per-rank feed that loads them."""

from trainers.data import accounting
from trainers.data.loader import Feed, StepChunks, StepDataset
from trainers.data.parquet import ParquetFiles, write_parquet
from trainers.data.plan import BatchPlan, Cursor, StepMicroBatches, micro_batches, padding_fraction, rank_share
from trainers.data.sources import FeatureSource, PairsSource, TokenSource

__all__ = ["BatchPlan", "accounting", "Cursor", "Feed", "FeatureSource", "PairsSource", "ParquetFiles", "StepChunks",
           "StepDataset", "StepMicroBatches", "TokenSource", "micro_batches", "padding_fraction", "rank_share",
           "write_parquet"]
