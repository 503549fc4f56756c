"""The batch plan: world-size independent, exactly-once per epoch across a resize, budgets kept."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from trainers.data import BatchPlan, StepMicroBatches, micro_batches, padding_fraction, rank_share


def consumed(plan: BatchPlan, start: int, stop: int, world: int, micro: int, max_tokens=None) -> list[int]:
    """Every index all ranks' loaders yield for steps [start, stop) (the loop's exact inputs)."""
    out = []
    for rank in range(world):
        steps = StepMicroBatches(plan, rank, world, micro, max_tokens)
        out += [int(i) for step in range(start, stop) for mb in steps.at(step) for i in mb]
    return out


class Samples:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("first,then", [(1, {"min": 1, "max": 2}), ({"min": 1, "max": 4}, 2), (8, 1)])
def test_a_resume_with_another_num_workers_range_keeps_the_data_order(first, then):
    """1793 samples in batches of 64 leave a 1-sample tail: the plan (steps per epoch, every
    batch) must not move when the job resumes with another worker range."""
    from trainers.config.loading import validate
    from trainers.rules import plan_for, target_step

    def spec(workers):
        return validate({"training": {"batch_size": 64, "epochs": 3}, "distributed": {"num_workers": workers}})

    a, b = plan_for(spec(first), Samples(1793)), plan_for(spec(then), Samples(1793))
    assert a.steps_per_epoch == b.steps_per_epoch
    assert target_step(spec(first), a.steps_per_epoch) == target_step(spec(then), b.steps_per_epoch)
    for epoch in range(3):
        assert all(np.array_equal(x, y) for x, y in zip(a.batches(epoch), b.batches(epoch)))
    assert not np.array_equal(a.batches(0)[0], a.batches(1)[0]), "each epoch is a new shuffle"


@pytest.mark.parametrize("n,batch,steps,last", [
    (1000, 64, 15, 104),   # 15 full batches; the 40-sample tail joins the last one
    (1026, 64, 16, 66),    # a 2-sample tail merged into the batch before it
    (64, 64, 1, 64),
    (1793, 64, 28, 65),
])
def test_short_tail_is_merged(n, batch, steps, last):
    plan = BatchPlan(n, batch, seed=0, shuffle=False)
    assert plan.steps_per_epoch == steps
    assert len(plan.batches(0)[-1]) == last
    assert sorted(int(i) for b in plan.batches(0) for i in b) == list(range(n))


@pytest.mark.parametrize("before,after,stop_at", [(2, 1, 5), (4, 2, 7), (1, 3, 3), (2, 2, 9)])
def test_resize_mid_epoch_sees_every_sample_exactly_once(before, after, stop_at):
    plan = BatchPlan(1797, 128, seed=7)
    epoch = plan.steps_per_epoch
    seen = consumed(plan, 0, stop_at, before, micro=40) + consumed(plan, stop_at, epoch, after, micro=40)
    counts = Counter(seen)
    assert set(counts) == set(range(1797)) and set(counts.values()) == {1}
    assert plan.cursor(stop_at).position == stop_at * 128


def test_rank_shares_partition_the_batch():
    batch = list(range(10))
    shares = [rank_share(batch, r, 3) for r in range(3)]
    assert [len(s) for s in shares] == [3, 3, 4]
    assert sum(shares, []) == batch


def test_token_budget_is_never_exceeded_and_dynamic_pads_less():
    from trainers.workloads.datasets import stdlib_paragraphs

    lengths = np.array([min(len(p), 256) for p in stdlib_paragraphs(3000)])
    budget = 2048
    dynamic = BatchPlan(len(lengths), 64, seed=0, lengths=lengths)
    fixed = BatchPlan(len(lengths), 64, seed=0)
    dyn_mbs, fixed_mbs = [], []
    for step in range(dynamic.steps_per_epoch):
        for rank in range(2):
            dyn_mbs += StepMicroBatches(dynamic, rank, 2, 32, budget).at(step)
            fixed_mbs += StepMicroBatches(fixed, rank, 2, 8).at(step)
    assert all(int(lengths[mb].max()) * len(mb) <= budget for mb in dyn_mbs)
    dyn, fix = padding_fraction(dyn_mbs, lengths), padding_fraction(fixed_mbs, lengths)
    assert dyn < fix / 3, (dyn, fix)


def test_micro_batches_fixed_size():
    assert [mb.tolist() for mb in micro_batches(list(range(7)), 3)] == [[0, 1, 2], [3, 4, 5], [6]]


def test_plan_refuses_data_smaller_than_a_batch():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        BatchPlan(10, 64, seed=0)


# ---------------------------------------------------------------- the streaming shuffle (pure functions)

from trainers.data.plan import epoch_order  # noqa: E402


@pytest.mark.parametrize("sizes,window", [
    ([100] * 10, 1), ([100] * 10, 3), ([100] * 10, 10), ([7, 300, 1, 64, 64], 2), ([1797], 4),
])
def test_epoch_order_is_a_permutation_read_one_window_at_a_time(sizes, window):
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    order, window_starts = epoch_order(sizes, seed=3, epoch=1, window=window)
    assert sorted(order.tolist()) == list(range(sum(sizes)))
    bounds = [*window_starts.tolist(), len(order)]
    assert len(bounds) - 1 == -(-len(sizes) // window)
    for a, b in zip(bounds, bounds[1:]):
        groups = set((np.searchsorted(offsets, order[a:b], side="right") - 1).tolist())
        assert len(groups) <= window and sum(sizes[g] for g in groups) == b - a  # whole row groups, no more


@pytest.mark.parametrize("a,b,same", [
    ((0, 0), (0, 0), True), ((0, 0), (0, 1), False), ((0, 0), (1, 0), False), ((5, 2), (5, 2), True),
])
def test_epoch_order_is_a_function_of_seed_and_epoch(a, b, same):
    sizes = [50] * 8
    x, _ = epoch_order(sizes, seed=a[0], epoch=a[1], window=2)
    y, _ = epoch_order(sizes, seed=b[0], epoch=b[1], window=2)
    assert np.array_equal(x, y) == same


def test_without_shuffle_the_order_is_the_files_order():
    order, _ = epoch_order([3, 4, 5], seed=9, epoch=2, window=2, shuffle=False)
    assert order.tolist() == list(range(12))


def test_shuffle_mixes_within_a_window_and_moves_row_groups():
    order, _ = epoch_order([100] * 10, seed=0, epoch=0, window=2)
    first_groups = set((order[:200] // 100).tolist())
    assert len(first_groups) == 2 and first_groups != {0, 1} or order[:100].tolist() != list(range(100))
    assert np.abs(np.diff(order[:200])).mean() > 10, "samples inside a window are shuffled, not in file order"


@pytest.mark.parametrize("window,world", [(1, 1), (2, 2), (3, 4)])
def test_a_step_reads_from_at_most_two_windows_of_row_groups(window, world):
    sizes = [97] * 20
    plan = BatchPlan(sum(sizes), 64, seed=1, group_sizes=sizes, window=window)
    for step in range(plan.steps_per_epoch * 2):
        groups = set((plan.global_batch_at(step) // 97).tolist())
        assert len(groups) <= 2 * window


@pytest.mark.parametrize("before,after,stop_at", [(2, 1, 5), (3, 2, 11)])
def test_resize_mid_epoch_with_row_groups_sees_every_sample_once(before, after, stop_at):
    sizes = [130, 64, 200, 77, 300, 99, 150, 160]
    plan = BatchPlan(sum(sizes), 48, seed=2, group_sizes=sizes, window=3)
    epoch = plan.steps_per_epoch
    seen = consumed(plan, epoch, epoch + stop_at, before, micro=10) + \
        consumed(plan, epoch + stop_at, 2 * epoch, after, micro=10)
    assert Counter(seen) == Counter(range(sum(sizes)))


def test_dynamic_batching_within_windows_keeps_budget_and_pads_less():
    from trainers.workloads.datasets import stdlib_paragraphs

    lengths = np.array([min(len(p), 256) for p in stdlib_paragraphs(3000)])
    sizes = [500] * 6
    dynamic = BatchPlan(len(lengths), 64, seed=0, lengths=lengths, group_sizes=sizes, window=2)
    fixed = BatchPlan(len(lengths), 64, seed=0, group_sizes=sizes, window=2)
    dyn, fix = [], []
    for step in range(dynamic.steps_per_epoch):
        assert len(set((dynamic.global_batch_at(step) // 500).tolist())) <= 4
        for rank in range(2):
            dyn += StepMicroBatches(dynamic, rank, 2, 32, 2048).at(step)
            fix += StepMicroBatches(fixed, rank, 2, 8).at(step)
    assert all(int(lengths[mb].max()) * len(mb) <= 2048 for mb in dyn)
    assert Counter(int(i) for mb in dyn for i in mb) == Counter(range(len(lengths)))
    assert padding_fraction(dyn, lengths) < padding_fraction(fix, lengths) / 3


# ---------------------------------------------------------------- sources: Parquet by row group

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from trainers.data import FeatureSource, Feed, PairsSource, ParquetFiles, TokenSource  # noqa: E402


def feature_file(path, rows: int, group_rows: int, width: int = 5, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    table = pa.table({"feat": list(rng.random((rows, width), dtype=np.float32)), "cls": np.arange(rows) % 7,
                      "extra": np.zeros(rows)})
    pq.write_table(table, path, row_group_size=group_rows)
    return table


def test_feature_source_fetches_the_rows_asked_for_across_row_groups_and_files(tmp_path):
    folder = tmp_path / "set"
    folder.mkdir()
    a = feature_file(folder / "a.parquet", 250, 60, seed=1)
    b = feature_file(folder / "b.parquet", 90, 40, seed=2)
    source = FeatureSource(ParquetFiles(str(folder) + "/"), "feat", "cls")
    assert source.group_sizes.tolist() == [60, 60, 60, 60, 10, 40, 40, 10]
    x_all = np.concatenate([np.stack(t.column("feat").to_numpy(zero_copy_only=False)) for t in (a, b)])
    y_all = np.concatenate([t.column("cls").to_numpy() for t in (a, b)])
    ids = np.random.default_rng(0).permutation(len(source))[:77]
    out = list(source.fetch(ids, [30, 30, 17], upcoming=[]))
    assert [len(mb["y"]) for mb in out] == [30, 30, 17]
    assert torch.equal(torch.cat([mb["x"] for mb in out]), torch.from_numpy(x_all[ids]))
    assert torch.equal(torch.cat([mb["y"] for mb in out]), torch.from_numpy(y_all[ids]))


def test_token_source_pads_each_micro_batch_to_its_longest_and_cuts_at_max_len(tmp_path):
    seqs = [list(range(i % 13 + 1)) for i in range(100)]
    pq.write_table(pa.table({"toks": seqs}), tmp_path / "t.parquet", row_group_size=30)
    source = TokenSource(ParquetFiles(str(tmp_path / "t.parquet")), "toks", pad_id=-1, max_len=10)
    assert source.lengths.tolist() == [min(len(s), 10) for s in seqs]
    ids = np.array([5, 95, 31, 0, 64, 12])
    out = source.fetch(ids, [4, 2], upcoming=[])
    for mb, part in zip(out, (ids[:4], ids[4:])):
        want = [seqs[i][:10] for i in part]
        longest = max(len(w) for w in want)
        assert mb["tokens"].tolist() == [w + [-1] * (longest - len(w)) for w in want]
        assert mb["num_tokens"] == sum(len(w) for w in want)


def test_a_missing_column_names_the_field_the_column_and_the_fix(tmp_path):
    feature_file(tmp_path / "a.parquet", 10, 10)
    with pytest.raises(ValueError, match=r"data.columns.label: 'label' is not a column of .*a.parquet "
                                         r"\(it has cls, extra, feat\): name the right one in data.columns.label"):
        FeatureSource(ParquetFiles(str(tmp_path / "a.parquet")), "feat", "label")


def test_ragged_features_are_refused_with_the_column_named(tmp_path):
    pq.write_table(pa.table({"features": [[1.0, 2.0], [3.0]], "label": [0, 1]}), tmp_path / "r.parquet")
    source = FeatureSource(ParquetFiles(str(tmp_path / "r.parquet")))
    with pytest.raises(ValueError, match="'features' in .* has rows of different lengths"):
        source.fetch(np.array([0]), [1], [])


def test_a_missing_source_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        ParquetFiles(str(tmp_path / "nope.parquet"))


@pytest.mark.parametrize("workers", [0, 2])
def test_feed_yields_the_plan_and_holds_a_bounded_window_of_row_groups(tmp_path, workers):
    table = feature_file(tmp_path / "d.parquet", 3000, 100)  # 30 row groups
    x_all = torch.from_numpy(np.stack(table.column("feat").to_numpy(zero_copy_only=False)))
    source = FeatureSource(ParquetFiles(str(tmp_path / "d.parquet")), "feat", "cls")
    plan = BatchPlan(len(source), 96, seed=4, group_sizes=source.group_sizes, window=2)
    steps = StepMicroBatches(plan, 1, 2, 16)
    feed = Feed(source, steps, 3, 3 + plan.steps_per_epoch, workers, 2, torch.device("cpu"))
    for step in range(3, 3 + plan.steps_per_epoch):
        for mb in steps.at(step):
            assert torch.equal(feed.next()["x"], x_all[mb])
    if workers == 0:  # this process read them: a fetch and the next one span at most three windows
        assert 0 < source.cache.peak_groups <= 3 * plan.window < len(source.group_sizes)


def test_pairs_source_collates_a_users_items():
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.tensor([float(i)]), i * i

    out = list(PairsSource(Squares()).fetch(np.array([3, 1, 4]), [2, 1], []))
    assert out[0]["x"].tolist() == [[3.0], [1.0]] and out[0]["y"].tolist() == [9, 1] and out[1]["y"].tolist() == [16]


def test_a_tensor_dataset_is_fetched_by_indexing_its_tensors_with_what_item_reads_give():
    x, y = torch.randn(50, 3), torch.randint(0, 10, (50,))
    ids, sizes = np.array([7, 3, 49, 0, 12]), [3, 2]

    class ItemByItem(torch.utils.data.TensorDataset):
        def __getitem__(self, i):  # an override: the tensors may not be what it returns
            return super().__getitem__(i)

    class Normalised(torch.utils.data.TensorDataset):
        def __getitems__(self, ids):  # a batch transform of its own: it must be called
            return [(x[i] * 2, y[i]) for i in ids]

    slow, fast = PairsSource(ItemByItem(x, y)), PairsSource(torch.utils.data.TensorDataset(x, y))
    assert not slow.by_index and fast.by_index
    (doubled,) = PairsSource(Normalised(x, y)).fetch(ids[:3], [3], [])
    assert torch.equal(doubled["x"], x[ids[:3]] * 2)
    for a, b in zip(slow.fetch(ids, sizes, []), fast.fetch(ids, sizes, []), strict=True):
        assert a["x"].dtype == b["x"].dtype and a["y"].dtype == b["y"].dtype
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
    assert not PairsSource(torch.utils.data.TensorDataset(x, y, y)).by_index, "pairs only"
    assert not PairsSource(torch.utils.data.TensorDataset(x.to_sparse(), y)).by_index, "no gather of sparse tensors"


# ---------------------------------------------------------------- data.num_workers: auto (pure decision)

from trainers.data.autotune import LoaderSetting, ladder, next_setting  # noqa: E402

S = [LoaderSetting(0, 2), LoaderSetting(1, 2), LoaderSetting(2, 2), LoaderSetting(4, 2)]


@pytest.mark.parametrize("probes,want,done", [
    ([(0, 0.01)], S[0], True),                           # fast enough already: no workers
    ([(0, 0.5)], S[1], False),                           # waiting: try one worker
    ([(0, 0.5), (1, 0.2)], S[2], False),                 # better: go on
    ([(0, 0.5), (1, 0.2), (2, 0.02)], S[2], True),       # under the target: stay
    ([(0, 0.5), (1, 0.2), (2, 0.19)], S[2], False),      # no real gain yet: measure it again
    ([(0, 0.5), (1, 0.2), (2, 0.19), (2, 0.21)], S[1], True),  # again no gain: back to the best
    ([(0, 0.5), (1, 0.6)], S[1], False),                 # worse once (a start-up, a burst): again
    ([(0, 0.5), (1, 0.6), (1, 0.55)], S[0], True),       # worse twice: back to none
    ([(0, 0.665), (1, 0.826), (1, 0.35)], S[2], False),  # the second window shows the gain: go on
    ([(0, 0.5), (1, 0.6), (1, 0.02)], S[1], True),       # its best is under the target: stay
    ([(0, 0.5), (1, 0.3), (2, 0.2), (3, 0.1)], S[3], True),  # the top of the ladder: keep the best
])
def test_next_setting(probes, want, done):
    tried = [(S[i], wait) for i, wait in probes]
    assert next_setting(tried, tuple(S)) == (want, done)


def test_ladder_stops_at_the_machines_cpus_but_tries_two():
    assert max(s.num_workers for s in ladder(1)) == 2
    assert max(s.num_workers for s in ladder(8)) == 8
    assert ladder(8)[0] == LoaderSetting(0, 2)


class SlowItems(torch.utils.data.Dataset):
    """Items that take ``item_s`` each: a loader that needs processes to keep up."""

    def __init__(self, n: int, item_s: float):
        self.n, self.item_s = n, item_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import time

        time.sleep(self.item_s)
        return torch.tensor([float(i)]), i


def test_auto_feed_adds_workers_for_slow_data_and_keeps_its_choice(monkeypatch):
    import time

    import trainers.data.loader as loader

    monkeypatch.setattr(loader, "ladder", lambda: tuple(S[:3]))
    source = PairsSource(SlowItems(4000, 0.0005))
    plan = BatchPlan(len(source), 16, seed=0, group_sizes=source.group_sizes)
    steps = StepMicroBatches(plan, 0, 1, 16)
    lines = []
    feed = Feed(source, steps, 0, 240, "auto", 2, torch.device("cpu"), announce=lines.append)
    for step in range(240):  # each setting is measured for at least MIN_PROBE_S
        assert feed.next()["y"].tolist() == steps.at(step)[0].tolist()
        time.sleep(0.006)  # compute: 16 items load in 8 ms in one process, in 4 ms with two
    assert feed.state() is not None and feed.state()["num_workers"] > 0, feed.tried
    assert lines and "data.num_workers auto" in lines[0]
    again = Feed(source, steps, 240, 242, "auto", 2, torch.device("cpu"), tuned=feed.state())
    assert again.state() == feed.state() and not again.tuning
    fixed = Feed(source, steps, 240, 242, 0, 2, torch.device("cpu"), tuned=feed.state())
    assert fixed.setting == LoaderSetting(0, 2) and fixed.state() is None, "a count in the spec wins"


def wide_file(path, groups: int, group_rows: int = 1024, width: int = 1024) -> None:
    """Random float32 features (they do not compress) in row groups of group_rows x width x 4 bytes."""
    schema = pa.schema([("features", pa.list_(pa.float32(), width)), ("label", pa.int64())])
    rng = np.random.default_rng(0)
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        for _ in range(groups):
            values = pa.array(rng.random(group_rows * width, dtype=np.float32))
            writer.write_table(pa.table({"features": pa.FixedSizeListArray.from_arrays(values, width),
                                         "label": rng.integers(0, 10, group_rows)}, schema=schema))


def test_a_held_row_group_is_arrows_memory_not_a_copy_of_it(tmp_path):
    wide_file(tmp_path / "w.parquet", groups=1, group_rows=64, width=32)
    source = FeatureSource(ParquetFiles(str(tmp_path / "w.parquet")))
    table = source.files.read(0, source.columns)
    x, _ = source.decode(table)
    values = table.column(0).chunk(0).flatten().buffers()[1]
    assert values.address <= x.data_ptr() < values.address + values.size
    assert x.shape == (64, 32)


def resident_anon_bytes() -> int:
    with open("/proc/self/status") as status:
        return int(status.read().split("RssAnon:")[1].split()[0]) * 1024


def test_memory_follows_the_row_groups_held_not_the_row_groups_read(tmp_path):
    """Reading 24 row groups of 4 MiB while holding 2: what the process keeps is a few groups'
    worth, not a growing pile of freed read buffers and dropped groups."""
    group_bytes = 1024 * 1024 * 4
    wide_file(tmp_path / "w.parquet", groups=24)
    source = FeatureSource(ParquetFiles(str(tmp_path / "w.parquet")))
    source.cache.hold([0, 1], [])
    before = resident_anon_bytes()
    for g in range(2, 24):
        source.cache.hold([g], [g + 1] if g < 23 else [])
    grown = resident_anon_bytes() - before
    assert source.cache.peak_groups == 2
    assert grown < 4 * group_bytes, f"grew {grown >> 20} MiB while holding 2 groups of {group_bytes >> 20} MiB"


# ---------------------------------------------------------------- sample-id accounting

from trainers.data import accounting  # noqa: E402


@pytest.mark.parametrize("workers", [0, 2])
def test_a_recording_feed_keeps_the_ids_it_handed_out_per_step(tmp_path, workers):
    feature_file(tmp_path / "d.parquet", 600, 50)
    source = FeatureSource(ParquetFiles(str(tmp_path / "d.parquet")), "feat", "cls")
    plan = BatchPlan(len(source), 64, seed=2, group_sizes=source.group_sizes, window=2)
    steps = StepMicroBatches(plan, 1, 2, 8)
    feed = Feed(source, steps, 5, 15, workers, 2, torch.device("cpu"), record_ids=True)
    for step in range(5, 9):
        for _ in steps.at(step):
            feed.next()
    want = [rank_share(plan.global_batch_at(s), 1, 2).tolist() for s in range(5, 9)]
    assert feed.take_record() == (5, want)
    for _ in steps.at(9):
        feed.next()
    assert feed.take_record() == (9, [rank_share(plan.global_batch_at(9), 1, 2).tolist()])
    quiet = Feed(source, steps, 5, 15, 0, 2, torch.device("cpu"))
    quiet.next()
    assert quiet.take_record() == (5, []), "off by default: nothing kept"


def planned(plan: BatchPlan, start: int, stop: int, world: int) -> dict:
    return accounting.record(start, stop, world, [[rank_share(plan.global_batch_at(s), r, world).tolist()
                                                   for s in range(start, stop)] for r in range(world)])


def test_the_chain_of_checkpoint_records_proves_each_epoch_exactly_once():
    plan = BatchPlan(100, 10, seed=1)  # 10 steps an epoch
    records = [planned(plan, 0, 4, 2), planned(plan, 4, 8, 2),
               planned(plan, 8, 12, 2),  # saved, but lost with its node before the run went on from it
               planned(plan, 8, 11, 1), planned(plan, 11, 16, 1), planned(plan, 16, 25, 2)]
    by_step = accounting.trained_by_step(records)
    assert sorted(by_step) == list(range(25))
    assert accounting.epoch_problems(by_step, plan.steps_per_epoch, plan.num_samples) == []


def test_accounting_names_skipped_and_repeated_samples_and_a_broken_chain():
    plan = BatchPlan(100, 10, seed=1)
    good = [planned(plan, 0, 5, 2), planned(plan, 5, 10, 1)]
    bad = [dict(r) for r in good]
    bad[1] = accounting.record(5, 10, 1, [[*planned(plan, 5, 10, 1)["ranks"][0][:4], plan.global_batch_at(0).tolist()]])
    problems = accounting.epoch_problems(accounting.trained_by_step(bad), 10, 100)
    assert len(problems) == 1 and problems[0].startswith("epoch 0: 10 samples skipped") and "10 repeated" in problems[0]
    with pytest.raises(ValueError, match="no record ends at step 5: the chain of checkpoints is broken"):
        accounting.trained_by_step(good[1:])
    with pytest.raises(ValueError, match="rank 0 recorded 4 steps, not the 5 from 5 to 10"):
        accounting.record(5, 10, 1, [good[1]["ranks"][0][:4]])


def test_gather_on_one_worker_is_its_own_record(tmp_path):
    feature_file(tmp_path / "d.parquet", 300, 50)
    source = FeatureSource(ParquetFiles(str(tmp_path / "d.parquet")), "feat", "cls")
    plan = BatchPlan(len(source), 32, seed=0, group_sizes=source.group_sizes)
    steps = StepMicroBatches(plan, 0, 1, 32)
    feed = Feed(source, steps, 0, 9, 0, 2, torch.device("cpu"), record_ids=True)
    for _ in range(3):
        feed.next()
    assert accounting.gather(feed, 1, 3) == planned(plan, 0, 3, 1)


def test_a_loader_setting_from_a_checkpoint_is_one_of_the_ladders_or_none():
    """A checkpoint is data (storage is writable by more than our jobs): a saved setting of 4096 loader
    processes is not started; the feed tunes again from the ladder's first step."""
    source = PairsSource(SlowItems(64, 0.0))
    plan = BatchPlan(len(source), 16, seed=0, group_sizes=source.group_sizes)
    steps = StepMicroBatches(plan, 0, 1, 16)
    for forged in ({"num_workers": 4096, "prefetch_factor": 1 << 20}, {"num_workers": "8"}, {}):
        feed = Feed(source, steps, 0, 2, "auto", 2, torch.device("cpu"), tuned=forged)
        assert feed.setting == ladder()[0] and feed.tuning, (forged, feed.setting)
    kept = Feed(source, steps, 0, 2, "auto", 2, torch.device("cpu"), tuned={"num_workers": 0, "prefetch_factor": 2})
    assert kept.setting == LoaderSetting(0, 2) and not kept.tuning


def test_a_manifest_names_only_files_in_its_checkpoints_folder(tmp_path):
    import json

    import pyarrow.fs as pafs

    from trainers.checkpoint_files import MANIFEST, read_manifest

    folder = tmp_path / "checkpoint_000001"
    folder.mkdir()
    for names in ({"state_file": "/etc/passwd", "files": {}}, {"state_file": "s.pt", "files": {"../x": {}}},
                  {"state_file": "..", "files": {}}):
        (folder / MANIFEST).write_text(json.dumps(names))
        with pytest.raises(ValueError, match="names a file outside its checkpoint's folder"):
            read_manifest(pafs.LocalFileSystem(), str(folder))
    (folder / MANIFEST).write_text(json.dumps(["s.pt"]))
    with pytest.raises(ValueError, match="not a mapping of a state file and its files"):
        read_manifest(pafs.LocalFileSystem(), str(folder))
    (folder / MANIFEST).write_text(json.dumps({"state_file": "s.pt", "files": {"s.pt": {"size": 1}}}))
    assert read_manifest(pafs.LocalFileSystem(), str(folder))["state_file"] == "s.pt"
