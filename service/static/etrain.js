// elastic-train's page script, served by the service itself (CSP: script-src 'self').
// It refreshes the page in place: the jobs table from /ui/jobs-table, a job's parts and
// curves from /ui/jobs/<id>/data. Parts arrive as HTML the server escaped; this script
// never builds HTML from a job's text (labels go in through textContent and title).
(function () {
  "use strict";
  var REFRESH_MS = 3000;

  function get(url, kind) {
    return fetch(url, {credentials: "same-origin", cache: "no-store"}).then(function (r) {
      if (!r.ok) { throw new Error(url + ": " + r.status); }
      return kind === "json" ? r.json() : r.text();
    });
  }

  // ------------------------------------------------------------ the jobs list
  var jobs = document.getElementById("jobs-part");
  if (jobs) {
    setInterval(function () {
      get(jobs.dataset.refresh, "text").then(function (html) { jobs.innerHTML = html; }).catch(function () {});
    }, REFRESH_MS * 2);
  }

  // ------------------------------------------------------------ one job
  var job = document.getElementById("job");
  if (!job || typeof uPlot === "undefined") { return; }

  var CHARTS = [
    {id: "loss-chart", series: [{key: "loss", label: "loss", color: "#2457c5"}]},
    {id: "lr-chart", series: [{key: "learning_rate", label: "learning rate", color: "#7a3fd1"}]},
    {id: "throughput-chart", series: [{key: "samples_per_s", label: "samples/s", color: "#067647"},
                                      {key: "tokens_per_s", label: "tokens/s", color: "#b54708", optional: true}]},
    {id: "wait-chart", series: [{key: "data_wait_fraction", label: "data-wait fraction", color: "#b54708",
                                 percent: true}]},
    {id: "world-chart", height: 120, whole: true, series: [{key: "world_size", label: "world size", color: "#1b1f24", stepped: true}]}
  ];
  // Steps and workers come whole: their axes tick at 1, 2, 5, 10, 20, 25, 50, ...
  var WHOLE = [1, 2, 5].concat([].concat.apply([], [1, 2, 3, 4, 5, 6, 7, 8].map(function (e) {
    var p = Math.pow(10, e);
    return [p, 2 * p, 2.5 * p, 5 * p];
  })));
  var charts = {};
  var marks = [];
  window.etrainCharts = charts;  // for people (and tests) poking at the page from DevTools

  function fmt(v) {
    if (v === null || v === undefined) { return "-"; }
    var a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) { return v.toExponential(2); }
    if (a >= 100) { return Math.round(v).toLocaleString(); }
    return String(+v.toPrecision(4));
  }

  function drawMarks(u) {
    var over = u.over;
    over.querySelectorAll(".interruption-marker").forEach(function (el) { el.remove(); });
    marks.forEach(function (m) {
      var x = u.valToPos(m.step, "x");
      if (!(x >= 0 && x <= over.clientWidth)) { return; }
      var el = document.createElement("div");
      el.className = "interruption-marker";
      el.style.left = x + "px";
      el.title = m.label;
      var tag = document.createElement("span");
      tag.textContent = m.cause;
      el.appendChild(tag);
      over.appendChild(el);
    });
  }

  function columns(spec, series) {
    var shown = spec.series.filter(function (s) {
      return !s.optional || (series[s.key] || []).some(function (v) { return v; });
    });
    return {shown: shown, data: [series.step].concat(shown.map(function (s) { return series[s.key]; }))};
  }

  function makeChart(spec, cols, el) {
    var width = Math.max(320, el.clientWidth || 560);
    var yValues = function (u, splits) {
      return splits.map(function (v) { return spec.series[0].percent ? +(v * 100).toPrecision(2) + "%" : fmt(v); });
    };
    var opts = {
      width: width, height: spec.height || 190, cursor: {sync: {key: "etrain"}, drag: {x: true, y: false}},
      scales: {x: {time: false}},
      axes: [{label: "step", labelSize: 18, stroke: "#667085", grid: {stroke: "#eef0f3"}, ticks: {stroke: "#e4e7ec"},
              incrs: WHOLE},
             {stroke: "#667085", grid: {stroke: "#eef0f3"}, ticks: {stroke: "#e4e7ec"}, size: 64, values: yValues,
              incrs: spec.whole ? WHOLE : undefined}],
      series: [{label: "step", value: function (u, v) { return v === null ? "-" : String(v); }}].concat(
        cols.shown.map(function (s) {
          return {label: s.label, stroke: s.color, width: 1.6, spanGaps: true,
                  fill: s.stepped ? "rgba(27,31,36,0.05)" : undefined,
                  paths: s.stepped ? uPlot.paths.stepped({align: 1}) : undefined,
                  points: {show: false},
                  value: function (u, v) { return s.percent && v !== null ? (v * 100).toFixed(1) + "%" : fmt(v); }};
        })),
      hooks: {draw: [drawMarks]}
    };
    el.textContent = "";
    var u = new uPlot(opts, cols.data, el);
    u.etrainSeries = cols.shown.map(function (s) { return s.key; }).join(",");
    return u;
  }

  function drawCharts(chart) {
    marks = chart.interruptions || [];
    CHARTS.forEach(function (spec) {
      var el = document.querySelector("#" + spec.id + " .plot");
      var cols = columns(spec, chart.series);
      var have = cols.data[0].length > 0;
      var u = charts[spec.id];
      if (!have) {
        if (!u) { el.textContent = "no data yet: the first points arrive with the first checkpoint"; el.className = "plot empty"; }
        return;
      }
      el.className = "plot";
      var keys = cols.shown.map(function (s) { return s.key; }).join(",");
      if (u && u.etrainSeries === keys) {
        u.setData(cols.data);
      } else {
        if (u) { u.destroy(); }
        charts[spec.id] = makeChart(spec, cols, el);
      }
    });
  }

  window.addEventListener("resize", function () {
    CHARTS.forEach(function (spec) {
      var u = charts[spec.id];
      var el = document.querySelector("#" + spec.id + " .plot");
      if (u && el.clientWidth) { u.setSize({width: el.clientWidth, height: spec.height || 190}); }
    });
  });

  // ------------------------------------------------------------ the log: filters and follow
  var source = document.getElementById("log-source");
  var level = document.getElementById("log-level");
  var follow = document.getElementById("log-follow");
  var count = document.getElementById("log-count");

  function applyLog() {
    var log = document.getElementById("log");
    if (!log) { return; }
    log.className = "log src-" + source.value + " lvl-" + level.value;
    var lines = log.querySelectorAll(".line");
    var shown = 0;
    lines.forEach(function (l) { if (getComputedStyle(l).display !== "none") { shown += 1; } });
    count.textContent = shown + " of " + lines.length + " lines";
    if (follow.checked) { log.scrollTop = log.scrollHeight; }
  }
  source.addEventListener("change", applyLog);
  level.addEventListener("change", applyLog);
  follow.addEventListener("change", applyLog);

  var active = job.dataset.active === "yes";
  function refresh() {
    return get(job.dataset.url, "json").then(function (d) {
      var log = document.getElementById("log");
      var scrolled = log ? log.scrollTop : 0;
      Object.keys(d.html).forEach(function (part) {
        var el = document.getElementById(part + "-part");
        if (el) { el.innerHTML = d.html[part]; }
      });
      applyLog();
      if (!follow.checked && document.getElementById("log")) { document.getElementById("log").scrollTop = scrolled; }
      drawCharts(d.chart);
      job.dataset.state = d.state;
      var wasActive = active;
      active = d.active;
      if (wasActive || active) { setTimeout(tick, REFRESH_MS); }  // one last refresh after it finishes
    });
  }
  function tick() { refresh().catch(function () { setTimeout(tick, REFRESH_MS * 3); }); }
  tick();
})();
