// Line charts on uPlot (vendored, web/vendor/uplot). Colours follow the theme; the canvas follows
// its card's width. A chart holds plain arrays and redraws at most once per animation frame.

import uPlot from "../vendor/uplot/uPlot.esm.js";

function css(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

// A line needs two values: a series with a single value in view is drawn as its point instead.
function lone(values, i0, i1) {
  let n = 0;
  for (let i = i0; i <= i1 && n < 2; i++) if (values[i] !== null && values[i] !== undefined) n++;
  return n === 1;
}

export class LineChart {
  /**
   * series: [{label, color: "--chart-1", points: false}]; format(v) for the y axis and legend.
   */
  constructor(container, { series, format = (v) => v, yLog = false }) {
    this.container = container;
    this.seriesDefs = series;
    this.format = format;
    this.yLog = yLog;
    this.data = [[], ...series.map(() => [])];
    this.pending = false;
    this.plot = null;
    this.build();
    this.resizeObserver = new ResizeObserver(() => this.resize());
    this.resizeObserver.observe(container);
    this.onTheme = () => { this.destroyPlot(); this.build(); };
    window.addEventListener("megatrain:theme", this.onTheme);
  }

  build() {
    const axis = { stroke: css("--muted"), grid: { stroke: css("--chart-grid"), width: 1 }, ticks: { stroke: css("--chart-grid") } };
    const fmt = this.format;
    const opts = {
      width: Math.max(this.container.clientWidth, 200),
      height: 220,
      cursor: { drag: { x: true, y: false }, focus: { prox: 16 } },
      scales: { x: { time: false }, y: this.yLog ? { distr: 3 } : { auto: true } },
      legend: { live: true },
      // The visible x range, for tests and for anyone inspecting the page.
      hooks: { setScale: [(u, key) => { if (key === "x") Object.assign(this.container.dataset, { xMin: u.scales.x.min, xMax: u.scales.x.max }); }] },
      axes: [
        { ...axis, label: "step", labelSize: 18, size: 36 },
        { ...axis, size: 78, values: (_, ticks) => ticks.map(fmt) },
      ],
      series: [
        { label: "step", value: (_, v) => (v === null || v === undefined ? "—" : String(v)) },
        ...this.seriesDefs.map((s) => ({
          label: s.label,
          stroke: css(s.color || "--chart-1"),
          width: 1.5,
          spanGaps: true,
          // Filled, so a lone point reads as a value and not as an empty ring.
          points: { show: (u, si, i0, i1) => (s.points ?? false) || lone(u.data[si], i0, i1), size: 6, fill: css(s.color || "--chart-1") },
          value: (_, v) => (v === null || v === undefined ? "—" : fmt(v)),
        })),
      ],
    };
    this.plot = new uPlot(opts, this.data, this.container);
  }

  /** New series labels (the same count), e.g. once the run's device is known. */
  relabel(labels) {
    if (labels.every((l, i) => this.seriesDefs[i].label === l)) return;
    this.seriesDefs = this.seriesDefs.map((s, i) => ({ ...s, label: labels[i] }));
    this.destroyPlot();
    this.build();
  }

  destroyPlot() { if (this.plot) { this.plot.destroy(); this.plot = null; } }

  resize() {
    if (!this.plot) return;
    const w = Math.max(this.container.clientWidth, 200);
    if (w !== this.plot.width) this.plot.setSize({ width: w, height: 220 });
  }

  /** Replace all data: xs ascending, ys one array per series (null = no value at that x). */
  setData(xs, ys) {
    this.data = [xs, ...ys];
    this.redraw();
  }

  /** Append rows ([x, y1, y2, ...]) that come after the last x. */
  append(rows) {
    for (const row of rows) row.forEach((v, i) => this.data[i].push(v));
    this.redraw();
  }

  get length() { return this.data[0].length; }

  redraw() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      if (this.plot) this.plot.setData(this.data);
    });
  }

  destroy() {
    this.resizeObserver.disconnect();
    window.removeEventListener("megatrain:theme", this.onTheme);
    this.destroyPlot();
  }
}
