// Dymem dashboard for TensorBoard: an ES module loaded by TensorBoard's plugin iframe, which calls render().
// Plain DOM and inline SVG, no dependencies. Data comes from ./runs and ./data?run=NAME (see plugin.py).
//
// Views, per selected run (one run, or two side by side):
//   summary   key figures of the plan and the measured steps
//   measured  per plan: predicted vs measured device peak of its first step, the calibration; measured step peaks
//   timeline  device bytes in use by mobility group (modelled per dependency layer; measured per allocator event)
//   pool      the pool at the peak: live blocks by group, free gaps, fragmentation
//   schedule  per swapped tensor: swap-out, host residency, swap-in trigger, consumer; stalls in red
//   tensors   sortable table of the largest buffers live at the peak
// Stable hooks for tests: ids #dymem-<view>-<pane>, classes .dymem-*, data-* attributes with raw values.

const GROUPS = ['persistent', 'transient', 'mobile', 'other'];
const GROUP_LABELS = {
  persistent: 'persistent (weights, optimizer slots)',
  transient: 'transient (short-lived)',
  mobile: 'mobile (swapped in/out)',
  other: 'other',
};
const SVG_NS = 'http://www.w3.org/2000/svg';
// Width of the charts' coordinate system: the pane's width in CSS pixels, so that text keeps its size (set per draw).
let chartWidth = 760;
// Byte scale per chart source ('model', 'trace') shared by the panes when two runs are compared.
let sharedScale = {};
// The files each view reads (messages about a file are shown in these views).
const VIEW_FILES = {
  summary: ['meta.json', 'plan.json', 'steps.jsonl'],
  measured: ['plans.jsonl'],
  timeline: ['timeline.json'],
  pool: ['trace.csv'],
  schedule: ['schedule.json'],
  tensors: [],
};

// ------------------------------------------------------------------------------------------------ formatting
export function formatBytes(n) {
  if (n === null || n === undefined || !isFinite(n)) return '–';
  const sign = n < 0 ? '-' : '';
  const a = Math.abs(n);
  if (a < 1024) return `${sign}${Math.round(a)} B`;
  if (a < 1024 ** 2) return `${sign}${(a / 1024).toFixed(1)} KiB`;
  if (a < 1024 ** 3) return `${sign}${(a / 1024 ** 2).toFixed(1)} MiB`;
  return `${sign}${(a / 1024 ** 3).toFixed(2)} GiB`;
}

function formatSeconds(s) {
  if (s === null || s === undefined || !isFinite(s)) return '–';
  if (Math.abs(s) < 1e-3) return `${(s * 1e6).toFixed(1)} µs`;
  if (Math.abs(s) < 1) return `${(s * 1e3).toFixed(2)} ms`;
  return `${s.toFixed(3)} s`;
}

function formatPercent(f) {
  return f === null || f === undefined || !isFinite(f) ? '–' : `${(100 * f).toFixed(1)} %`;
}

// (measured - predicted) / measured, signed: + when the plan predicted less than was measured.
function formatError(e) {
  if (e === null || e === undefined || !isFinite(e)) return '–';
  return `${e < 0 ? '−' : '+'}${Math.abs(100 * e).toFixed(1)} %`;
}

function formatNumber(x) {
  if (x === null || x === undefined || !isFinite(x)) return '–';
  return Number.isInteger(x) ? String(x) : x.toFixed(2);
}

// ------------------------------------------------------------------------------------------------ DOM helpers
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  for (const c of children.flat()) {
    if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  setAttrs(node, attrs);
  for (const c of children.flat()) {
    if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

function setAttrs(node, attrs) {
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === 'class') node.setAttribute('class', v);
    else if (k === 'text') node.textContent = v;
    else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? '' : String(v));
  }
}

// " (k of them optimizer state ..., j weights ...)" for a swap schedule's summary line, or "".
function kindNote(swaps) {
  const state = swaps.filter((s) => s.kind === 'variable').length;
  const weights = swaps.filter((s) => s.kind === 'weight').length;
  const parts = [];
  if (state) parts.push(`${state} of them optimizer state offloaded between its uses`);
  if (weights) parts.push(`${weights} of them weights in host memory between their uses`);
  const recomputed = swaps.filter((s) => s.kind === 'recompute').length;
  if (recomputed) parts.push(`${recomputed} of them recomputed for the backward pass instead of copied`);
  return parts.length ? ` (${parts.join(', ')})` : '';
}

function message(text, level = 'info', kind = null) {
  return el('div', {class: `dymem-message dymem-message-${level}`, 'data-level': level, 'data-kind': kind, role:
    level === 'error' ? 'alert' : 'status'}, text);
}

function tooltip(text) {
  return svg('title', {}, text);
}

function tickLabel(value, ticks) {
  const step = ticks.length > 1 ? ticks[1] - ticks[0] : 1;
  const decimals = Math.max(0, Math.min(6, -Math.floor(Math.log10(step) + 1e-9)));
  return value.toFixed(decimals);
}

function niceTicks(max, count = 5) {
  if (!(max > 0)) return [0];
  const raw = max / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let v = 0; v <= max + 1e-9; v += step) ticks.push(v);
  return ticks;
}

function byteTicks(max, count = 5) {
  // Ticks at round binary sizes (multiples of 2^k, 2^k/2 or 2^k/4).
  if (!(max > 0)) return [0];
  const raw = max / count;
  const pow = 2 ** Math.floor(Math.log2(raw));
  const step = [pow, 2 * pow].find((s) => s >= raw) || 2 * pow;
  const ticks = [];
  for (let v = 0; v <= max + 1e-9; v += step) ticks.push(v);
  return ticks;
}

// ------------------------------------------------------------------------------------------------ data access
async function fetchJSON(url) {
  let response;
  try {
    response = await fetch(url, {cache: 'no-store'});
  } catch (err) {
    throw new Error(`TensorBoard did not answer (${err.message}). Is it still running?`);
  }
  let body = null;
  try {
    body = await response.json();
  } catch (err) {
    throw new Error(`${url} answered ${response.status} with a body that is not JSON`);
  }
  if (!response.ok) {
    throw new Error(body && body.error ? body.error : `${url} answered ${response.status}`);
  }
  return body;
}

// ------------------------------------------------------------------------------------------------ entry point
export async function render() {
  document.head.append(el('link', {rel: 'stylesheet', href: './style.css'}));
  const root = el('div', {id: 'dymem-root', 'data-state': 'loading'});
  document.body.append(root);
  const selA = el('select', {id: 'dymem-run-a', class: 'dymem-run-select', 'aria-label': 'run'});
  const selB = el('select', {id: 'dymem-run-b', class: 'dymem-run-select', 'aria-label': 'compare with run'});
  const reload = el('button', {id: 'dymem-reload', type: 'button', title: 'Read the log directory again'},
      'Reload');
  const header = el('header', {class: 'dymem-header'},
      el('h1', {}, 'Dymem memory'),
      el('label', {}, 'Run ', selA),
      el('label', {}, 'compare with ', selB),
      reload);
  const globalMessages = el('div', {id: 'dymem-global-messages'});
  const panes = el('div', {id: 'dymem-panes', class: 'dymem-panes'});
  root.append(header, globalMessages, panes);

  const state = {runs: [], token: 0};

  async function loadRuns() {
    globalMessages.textContent = '';
    let listing;
    try {
      listing = await fetchJSON('./runs');
    } catch (err) {
      globalMessages.append(message(`Cannot list the runs: ${err.message}`, 'error', 'error'));
      root.dataset.state = 'error';
      return false;
    }
    state.runs = listing.runs || [];
    root.dataset.runs = String(state.runs.length);
    header.classList.toggle('dymem-no-runs', !state.runs.length);
    if (!state.runs.length) {
      panes.textContent = '';
      globalMessages.append(message(listing.message || 'No Dymem runs in this log directory.', 'info', 'empty'));
      root.dataset.state = 'empty';
      return false;
    }
    const keepA = selA.value;
    const keepB = selB.value;
    selA.textContent = '';
    selB.textContent = '';
    selB.append(el('option', {value: ''}, '(none)'));
    for (const run of state.runs) {
      selA.append(el('option', {value: run}, run));
      selB.append(el('option', {value: run}, run));
    }
    selA.value = state.runs.includes(keepA) ? keepA : state.runs[0];
    selB.value = state.runs.includes(keepB) ? keepB : '';
    return true;
  }

  async function update() {
    const token = ++state.token;
    const selected = [selA.value, selB.value].filter((r) => r);
    root.dataset.state = 'loading';
    const results = await Promise.all(selected.map(async (run) => {
      try {
        return {run, data: await fetchJSON(`./data?run=${encodeURIComponent(run)}`)};
      } catch (err) {
        return {run, error: err.message};
      }
    }));
    if (token !== state.token) return; // a newer selection is being drawn
    const available = panes.clientWidth || document.documentElement.clientWidth || 1200;
    chartWidth = Math.max(420, Math.floor(available / results.length) - 48);
    panes.classList.toggle('dymem-compare', results.length > 1);
    const draw = () => {
      panes.textContent = '';
      results.forEach((res, i) => panes.append(renderPane(res, i === 0 ? 'a' : 'b')));
    };
    sharedScale = {};
    draw();
    if (results.length > 1) {
      // Redraw once with the larger byte scale of each chart kind, so that the two runs compare by eye.
      for (const fig of panes.querySelectorAll('figure.dymem-chart')) {
        const source = fig.dataset.source;
        sharedScale[source] = Math.max(sharedScale[source] || 0, Number(fig.dataset.yMax));
      }
      draw();
    }
    root.dataset.state = 'ready';
  }

  selA.addEventListener('change', update);
  selB.addEventListener('change', update);
  reload.addEventListener('click', async () => {
    if (await loadRuns()) await update();
  });
  if (await loadRuns()) await update();
}

// ------------------------------------------------------------------------------------------------ one run
function renderPane(result, key) {
  const pane = el('section', {id: `dymem-pane-${key}`, class: 'dymem-pane', 'data-run': result.run});
  pane.append(el('h2', {class: 'dymem-run-title'}, result.run));
  if (result.error) {
    pane.append(message(result.error, 'error', 'error'));
    pane.dataset.state = 'error';
    return pane;
  }
  const data = result.data;
  const messages = data.messages || [];
  const viewed = new Set(Object.values(VIEW_FILES).flat());
  const loose = messages.filter((m) => !viewed.has(m.file));
  if (loose.length) {
    pane.append(el('div', {class: 'dymem-messages'}, loose.map((m) => message(m.text, m.level, m.level))));
  }
  const views = [
    ['summary', 'Summary', renderSummary],
    ['measured', 'Predicted vs measured', renderMeasured],
    ['timeline', 'Memory timeline', renderTimeline],
    ['pool', 'Pool at the peak', renderPool],
    ['schedule', 'Swap schedule', renderSchedule],
    ['tensors', 'Largest tensors at the peak', renderTensors],
  ];
  for (const [name, title, draw] of views) {
    const section = el('section', {id: `dymem-${name}-${key}`, class: `dymem-view dymem-${name}`});
    section.append(el('h3', {}, title));
    const own = messages.filter((m) => VIEW_FILES[name].includes(m.file));
    if (own.length) {
      section.append(el('div', {class: 'dymem-messages'}, own.map((m) => message(m.text, m.level, m.level))));
    }
    try {
      draw(section, data);
    } catch (err) {
      section.append(message(`This view could not be drawn: ${err.message}`, 'error', 'error'));
    }
    pane.append(section);
  }
  pane.dataset.state = 'ready';
  return pane;
}

// ------------------------------------------------------------------------------------------------ summary
function lastDefined(steps, key) {
  for (let i = steps.length - 1; i >= 0; i--) {
    if (typeof steps[i][key] === 'number') return steps[i][key];
  }
  return null;
}

function maxOf(steps, key) {
  let best = null;
  for (const s of steps) {
    if (typeof s[key] === 'number' && (best === null || s[key] > best)) best = s[key];
  }
  return best;
}

function renderSummary(section, data) {
  const plan = data.plan || {};
  const meta = data.meta || {};
  const p = plan.predicted || {};
  const steps = data.steps || [];
  const figures = [
    ['policy', 'Policy', plan.policy || meta.policy, (v) => v],
    ['device', 'Cost-model device', plan.device || meta.device, (v) => v],
    ['batch_size', 'Batch size', plan.batch_size ?? meta.batch_size, formatNumber],
    ['budget_bytes', 'Memory budget', plan.budget_bytes ?? meta.budget_bytes, formatBytes],
    ['num_layers', 'Dependency layers', plan.num_layers, formatNumber],
    ['num_swaps', 'Swapped tensors', plan.num_swaps, formatNumber],
    ['swapped_bytes', 'Bytes swapped per step', plan.swapped_bytes, formatBytes],
    ['predicted_peak_bytes', 'Modelled peak', p.peak_bytes, formatBytes],
    ['no_swap_peak_bytes', 'Modelled peak without swapping', p.no_swap_peak_bytes, formatBytes],
    ['stall_s', 'Modelled stall per step', p.stall_s, formatSeconds],
    ['step_time_s', 'Modelled step time', p.step_time_s, formatSeconds],
    ['first_step_peak_bytes', 'Measured peak, first step of this plan',
      (plan.measured || {}).outcome === 'ran' ? (plan.measured || {}).peak_bytes : null, formatBytes],
    ['first_step_error', 'Error of the modelled peak, first step ((measured − modelled) / measured)',
      (plan.measured || {}).exact !== false ? (plan.measured || {}).error : null, formatError],
    ['steps', 'Steps recorded', steps.length || null, formatNumber],
    ['peak_bytes_in_use', 'Measured device peak', maxOf(steps, 'peak_bytes_in_use'), formatBytes],
    ['peak_bytes_reserved', 'Measured pool reserved (peak)', maxOf(steps, 'peak_bytes_reserved'), formatBytes],
    ['host_peak_bytes_in_use', 'Host pool peak', maxOf(steps, 'host_peak_bytes_in_use'), formatBytes],
    ['reserved_overhead', 'Reserved overhead (1 − in use / reserved, last step)',
      lastDefined(steps, 'reserved_overhead'), formatPercent],
  ];
  const list = el('dl', {class: 'dymem-figures'});
  let count = 0;
  for (const [k, label, value, fmt] of figures) {
    if (value === null || value === undefined || value === '') continue;
    list.append(el('div', {class: 'dymem-figure', 'data-key': k},
        el('dt', {}, label), el('dd', {'data-value': value}, fmt(value))));
    count++;
  }
  section.dataset.count = String(count);
  if (!count) {
    section.append(message('Nothing recorded for this run yet.', 'info', 'empty'));
    return;
  }
  section.append(list);
  for (const note of [...(plan.notes || []), ...(meta.notes || [])]) {
    section.append(el('p', {class: 'dymem-note'}, note));
  }
}

// ------------------------------------------------------------------------------------------------ predicted vs measured
function runBudget(data) {
  const plans = data.plans || [];
  for (let i = plans.length - 1; i >= 0; i--) {
    if (plans[i].budget_bytes) return plans[i].budget_bytes;
  }
  return (data.plan && data.plan.budget_bytes) || (data.meta && data.meta.budget_bytes) || null;
}

function measuredText(p) {
  if (p.outcome === 'out_of_memory') return 'out of memory';
  if (p.measured_peak_bytes === null || p.measured_peak_bytes === undefined) return 'not measured';
  return `${p.measured_exact === false ? '≤ ' : ''}${formatBytes(p.measured_peak_bytes)}`;
}

const PLAN_COLUMNS = [
  {key: 'index', label: '#', fmt: (v) => String(v)},
  {key: 'stage', label: 'Stage', fmt: (v) => v || '–'},
  {key: 'batch_size', label: 'Batch', num: true, fmt: formatNumber},
  {key: 'num_swaps', label: 'Swaps', num: true, fmt: formatNumber},
  {key: 'predicted_peak_bytes', label: 'Predicted peak', num: true, fmt: formatBytes},
  {key: 'measured_peak_bytes', label: 'Measured peak (reserved)', num: true, text: measuredText},
  {key: 'measured_peak_bytes_in_use', label: 'In use', num: true, fmt: formatBytes},
  {key: 'error', label: 'Error', num: true, fmt: formatError},
];

function renderMeasured(section, data) {
  const plans = data.plans || [];
  section.dataset.count = String(plans.length);
  if (!plans.length) {
    showMissing(section, data, 'plans.jsonl', 'No plan in this run yet: each plan is written after its first step.');
    return;
  }
  section.dataset.measured = String(plans.filter((p) => p.outcome === 'ran' &&
    typeof p.measured_peak_bytes === 'number').length);
  section.append(el('p', {class: 'dymem-caption'},
      'The device peak each plan predicted, and what the allocator (GTBM) measured in the plan\'s first step: the ' +
      'peak of reserved pageblocks, what the budget holds (the peak in use is below it). Error = (measured − ' +
      'predicted) / measured; ≤ marks a step whose own peak an earlier step hid.'));
  const table = el('table', {class: 'dymem-plans-table'});
  table.append(el('thead', {}, el('tr', {}, PLAN_COLUMNS.map((c) => el('th', {'data-key': c.key,
    class: c.num ? 'dymem-num' : null}, c.label)))));
  const tbody = el('tbody');
  for (const p of plans) {
    tbody.append(el('tr', {class: `dymem-plan-row${p.outcome === 'out_of_memory' ? ' dymem-oom' : ''}`,
      'data-index': p.index, 'data-stage': p.stage || '', 'data-outcome': p.outcome || '',
      'data-exact': p.measured_exact === null || p.measured_exact === undefined ? '' : String(p.measured_exact),
      'data-predicted-bytes': p.predicted_peak_bytes ?? '', 'data-measured-bytes': p.measured_peak_bytes ?? '',
      'data-in-use-bytes': p.measured_peak_bytes_in_use ?? '', 'data-error': p.error ?? ''},
    PLAN_COLUMNS.map((c) => {
      const v = p[c.key];
      return el('td', {'data-key': c.key, 'data-value': v ?? '', class: c.num ? 'dymem-num' : null,
        title: c.key === 'stage' && p.function_name ? p.function_name : null}, c.text ? c.text(p) : c.fmt(v));
    })));
    const cal = p.calibration;
    if (cal) {
      const scaled = p.calibrated_predicted_peak_bytes;
      const budget = cal.budget_bytes ? ` of the ${formatBytes(cal.budget_bytes)} budget` : '';
      tbody.append(el('tr', {class: 'dymem-calibration-row', 'data-index': p.index,
        'data-raw-predicted-bytes': cal.predicted_peak_bytes ?? '', 'data-measured-bytes': cal.measured_peak_bytes ?? '',
        'data-headroom': cal.headroom ?? '', 'data-calibrated-bytes': scaled ?? ''},
      el('td', {}), el('td', {colspan: PLAN_COLUMNS.length - 1},
          `calibrated on the probe step: raw prediction ${formatBytes(cal.predicted_peak_bytes)}, measured ` +
          `${formatBytes(cal.measured_peak_bytes)} (error ${formatError(cal.error)}); headroom ` +
          `${formatPercent(cal.headroom)}${budget} kept free` +
          (typeof scaled === 'number' ? `; this plan's prediction scaled the same way: ${formatBytes(scaled)}` : '') +
          '.')));
    }
  }
  table.append(tbody);
  section.append(el('div', {class: 'dymem-scroll dymem-table-scroll'}, table));
  const chart = stepPeaksChart(data, plans);
  if (chart) section.append(chart);
  else section.append(message('No measured step peaks in this run (steps.jsonl has none: GTBM not active?).', 'info',
      'empty'));
}

// Per recorded step: the allocator's peaks against the predicted peak of the plan the step ran, and the budget.
function stepPeaksChart(data, plans) {
  const steps = (data.steps || []).filter((s) => typeof s.peak_bytes_reserved === 'number' ||
    typeof s.peak_bytes_in_use === 'number');
  if (!steps.length) return null;
  const byIndex = new Map(plans.map((p) => [p.index, p]));
  const planOf = (s) => (typeof s.plan === 'number' ? byIndex.get(s.plan) :
    (plans.length === 1 ? plans[0] : undefined));
  const points = steps.map((s) => {
    const p = planOf(s);
    return {x: s.step, reserved: s.peak_bytes_reserved, in_use: s.peak_bytes_in_use,
      predicted: p ? p.predicted_peak_bytes : null, calibrated: p ? p.calibrated_predicted_peak_bytes : null,
      plan: p ? p.index : null};
  });
  const budget = runBudget(data);
  const lines = [
    {key: 'reserved', label: 'measured peak reserved', cls: 'dymem-line-measured'},
    {key: 'in_use', label: 'measured peak in use', cls: 'dymem-line-inuse'},
    {key: 'predicted', label: 'predicted peak of the plan the step ran', cls: 'dymem-line-predicted'},
    {key: 'calibrated', label: 'predicted peak scaled by the calibration', cls: 'dymem-line-calibrated'},
  ].filter((l) => points.some((p) => typeof p[l.key] === 'number'));
  const values = points.flatMap((p) => lines.map((l) => p[l.key])).filter((v) => typeof v === 'number');
  // a budget far above every step would flatten the chart: it is then named above the scale, not drawn
  const budgetOnScale = budget && budget <= 4 * Math.max(1, ...values);
  const top = Math.max(1, ...values, budgetOnScale ? budget : 0);
  const yMax = Math.max(top, (sharedScale.steps || 0) / 1.08) * 1.08;
  const W = chartWidth;
  const H = Math.round(Math.min(260, Math.max(180, W * 0.2)));
  const m = {l: 72, r: 16, t: 14, b: 38};
  const x0 = points[0].x;
  const x1 = points[points.length - 1].x + 1;
  const sx = (x) => m.l + ((x - x0) / (x1 - x0)) * (W - m.l - m.r);
  const sy = (y) => H - m.b - (y / yMax) * (H - m.t - m.b);
  const chart = svg('svg', {viewBox: `0 0 ${W} ${H}`, class: 'dymem-svg dymem-steps-chart', role: 'img',
    'aria-label': 'measured step peaks against the predicted peak and the budget'});
  for (const v of byteTicks(yMax / 1.08)) {
    chart.append(svg('line', {x1: m.l, x2: W - m.r, y1: sy(v), y2: sy(v), class: 'dymem-grid'}));
    chart.append(svg('text', {x: m.l - 6, y: sy(v) + 4, class: 'dymem-tick', 'text-anchor': 'end'},
        formatBytes(v)));
  }
  const xTicks = niceTicks(x1 - x0, 8).filter((v) => Number.isInteger(v));
  for (const v of xTicks) {
    chart.append(svg('text', {x: sx(x0 + v + 0.5), y: H - m.b + 16, class: 'dymem-tick', 'text-anchor': 'middle'},
        String(x0 + v)));
  }
  chart.append(svg('text', {x: (m.l + W - m.r) / 2, y: H - 4, class: 'dymem-axis-label', 'text-anchor': 'middle'},
      'training step'));
  // where each plan takes over
  let previous = null;
  for (const p of points) {
    if (p.plan === null || p.plan === previous) continue;
    previous = p.plan;
    const plan = byIndex.get(p.plan);
    const x = sx(p.x);
    chart.append(svg('line', {x1: x, x2: x, y1: m.t, y2: H - m.b, class: 'dymem-marker', 'data-plan': p.plan}));
    chart.append(svg('text', {x: x + 4, y: m.t + 10, class: 'dymem-marker-label'},
        `plan #${p.plan}${plan && plan.stage ? ` (${plan.stage})` : ''}`));
  }
  const xs = points.map((p) => p.x);
  for (const line of lines) {
    chart.append(svg('path', {d: stepLine(xs, points.map((p) => p[line.key]), x1, sx, sy),
      class: `dymem-line ${line.cls}`, 'data-line': line.key}, tooltip(line.label)));
  }
  if (budgetOnScale) {
    chart.append(svg('line', {x1: m.l, x2: W - m.r, y1: sy(budget), y2: sy(budget),
      class: 'dymem-line dymem-line-budget', 'data-line': 'budget', 'data-bytes': budget},
    tooltip(`budget ${formatBytes(budget)}`)));
    chart.append(svg('text', {x: W - m.r - 4, y: sy(budget) - 4, class: 'dymem-budget-label',
      'text-anchor': 'end'}, `budget ${formatBytes(budget)}`));
  } else if (budget) {
    chart.append(svg('text', {x: W - m.r - 4, y: m.t + 10, class: 'dymem-budget-label', 'text-anchor': 'end',
      'data-line': 'budget', 'data-bytes': budget}, `budget ${formatBytes(budget)} ↑ (above the scale)`));
  }
  if (points.length <= 200) {
    for (const p of points) {
      if (typeof p.reserved !== 'number') continue;
      const over = budget && p.reserved > budget;
      chart.append(svg('circle', {cx: sx(p.x + 0.5), cy: sy(p.reserved), r: 2.5,
        class: `dymem-step-point${over ? ' dymem-over-budget' : ''}`, 'data-step': p.x, 'data-bytes': p.reserved},
      tooltip(`step ${p.x}: peak reserved ${formatBytes(p.reserved)}, in use ${formatBytes(p.in_use)}` +
        (typeof p.predicted === 'number' ? `; predicted ${formatBytes(p.predicted)}` : '') +
        (p.plan !== null ? ` (plan #${p.plan})` : ''))));
    }
  }
  const maxReserved = Math.max(0, ...points.map((p) => p.reserved || 0));
  const over = budget ? points.filter((p) => p.reserved > budget).length : 0;
  const figure = el('figure', {class: 'dymem-chart', 'data-source': 'steps', 'data-points': points.length,
    'data-peak-bytes': maxReserved, 'data-budget-bytes': budget ?? '', 'data-over-budget': over,
    'data-y-max': yMax});
  figure.append(el('figcaption', {}, 'Measured step peaks against the plan\'s predicted peak and the budget',
      el('span', {class: 'dymem-caption-figure'}, ` · highest ${formatBytes(maxReserved)}` +
        (budget ? `, ${over} step${over === 1 ? '' : 's'} over the budget` : ''))));
  figure.append(chart);
  figure.append(el('div', {class: 'dymem-legend'},
      lines.map((l) => el('span', {class: 'dymem-legend-item', 'data-line': l.key},
          el('i', {class: `dymem-swatch-line ${l.cls}`}), l.label)),
      budget ? el('span', {class: 'dymem-legend-item', 'data-line': 'budget'},
          el('i', {class: 'dymem-swatch-line dymem-line-budget'}), 'budget') : null));
  figure.append(el('p', {class: 'dymem-caption'},
      'The allocator\'s peaks are maxima since its last reset, which the callback makes when a fit, or a train ' +
      'function it re-planned, takes its first step: a later step shows the highest use up to it.'));
  return figure;
}

// ------------------------------------------------------------------------------------------------ timeline
function renderTimeline(section, data) {
  const tl = data.timeline;
  const measured = data.measured_timeline;
  const budget = (tl && tl.budget_bytes) ?? (data.plan && data.plan.budget_bytes) ?? null;
  let drawn = 0;
  if (tl && tl.points && tl.points.length) {
    const reserved = maxOf(data.steps || [], 'peak_bytes_reserved');
    const points = tl.points.map((p) => ({...p, x: p.layer, reserved}));
    const backward = tl.first_backward_layer;
    section.append(stackedChart({
      source: 'model',
      title: 'Modelled by the planner: the largest use in each dependency layer',
      xLabel: 'dependency layer',
      peakAt: (x) => `in layer ${x}`,
      points,
      xEnd: points[points.length - 1].x + 1,
      budget,
      lines: [
        {key: 'no_swap', label: 'in use without swapping (modelled)', cls: 'dymem-line-noswap'},
        {key: 'reserved', label: 'pool reserved (measured peak)', cls: 'dymem-line-reserved'},
      ],
      marker: backward !== null && backward !== undefined ? {x: backward, label: 'backward pass →'} : null,
    }));
    drawn++;
  }
  if (measured && measured.points && measured.points.length) {
    const points = measured.points;
    const last = points[points.length - 1].x;
    const inMs = measured.x_label.startsWith('ms');
    section.append(stackedChart({
      source: 'trace',
      title: `Measured by the allocator (trace) in the step with the peak (TensorFlow ${stepName(measured)})`,
      xLabel: measured.x_label,
      peakAt: (x) => (inMs ? `at ${formatSeconds(x / 1e3)}` : `at event ${x}`),
      points,
      xEnd: last + Math.max(1e-9, (last - points[0].x) / 200),
      budget: budget ?? deviceLimit(data, points),
      lines: [
        {key: 'reserved', label: 'reserved (pageblocks holding live buffers)', cls: 'dymem-line-reserved'},
        {key: 'extent', label: 'pool extent (highest end offset)', cls: 'dymem-line-extent'},
      ],
    }));
    drawn++;
  }
  section.dataset.count = String(drawn);
  if (!drawn) section.append(message('No timeline in this run.', 'info', 'empty'));
}

// The allocator's byte limit, when it is close enough to the plotted bytes to be worth a line (the default limit is
// the machine's RAM, which would flatten the chart).
function deviceLimit(data, points) {
  const limit = lastDefined(data.steps || [], 'bytes_limit');
  const top = Math.max(...points.map((p) => Math.max(p.reserved || 0, p.extent || 0, groupTotal(p))));
  return limit > 0 && limit <= 2 * top ? limit : null;
}

function groupTotal(p) {
  return GROUPS.reduce((s, g) => s + (p[g] || 0), 0);
}

function stepName(obj) {
  return `step id ${obj.step}`;
}

function stackedChart(opts) {
  const {points, budget} = opts;
  const groups = GROUPS.filter((g) => points.some((p) => p[g] > 0));
  const totals = points.map(groupTotal);
  let peakIndex = 0;
  totals.forEach((t, i) => {
    if (t > totals[peakIndex]) peakIndex = i;
  });
  const lineMax = Math.max(0, ...opts.lines.flatMap((l) => points.map((p) => (typeof p[l.key] === 'number' ?
    p[l.key] : 0))));
  const yMax = Math.max(1, totals[peakIndex], budget || 0, lineMax, (sharedScale[opts.source] || 0) / 1.08) * 1.08;
  const W = chartWidth;
  const H = Math.round(Math.min(340, Math.max(220, W * 0.26)));
  const m = {l: 72, r: 16, t: 14, b: 38};
  const x0 = points[0].x;
  const x1 = opts.xEnd > x0 ? opts.xEnd : x0 + 1;
  const sx = (x) => m.l + ((x - x0) / (x1 - x0)) * (W - m.l - m.r);
  const sy = (y) => H - m.b - (y / yMax) * (H - m.t - m.b);
  const chart = svg('svg', {viewBox: `0 0 ${W} ${H}`, class: 'dymem-svg', role: 'img',
    'aria-label': opts.title});
  // axes and grid
  for (const v of byteTicks(yMax / 1.08)) {
    chart.append(svg('line', {x1: m.l, x2: W - m.r, y1: sy(v), y2: sy(v), class: 'dymem-grid'}));
    chart.append(svg('text', {x: m.l - 6, y: sy(v) + 4, class: 'dymem-tick', 'text-anchor': 'end'},
        formatBytes(v)));
  }
  const xTicks = niceTicks(x1 - x0, 8);
  for (const v of xTicks) {
    chart.append(svg('text', {x: sx(x0 + v), y: H - m.b + 16, class: 'dymem-tick', 'text-anchor': 'middle'},
        tickLabel(x0 + v, xTicks)));
  }
  chart.append(svg('text', {x: (m.l + W - m.r) / 2, y: H - 4, class: 'dymem-axis-label',
    'text-anchor': 'middle'}, opts.xLabel));
  // stacked step areas
  const xs = points.map((p) => p.x);
  const lower = points.map(() => 0);
  for (const g of groups) {
    const upper = points.map((p, i) => lower[i] + (p[g] || 0));
    chart.append(svg('path', {d: stepArea(xs, lower, upper, x1, sx, sy), class: `dymem-area dymem-group-${g}`,
      'data-group': g}, tooltip(GROUP_LABELS[g])));
    upper.forEach((u, i) => (lower[i] = u));
  }
  // lines
  const legendLines = [];
  for (const line of opts.lines) {
    const ys = points.map((p) => p[line.key]);
    if (!ys.some((y) => typeof y === 'number')) continue;
    chart.append(svg('path', {d: stepLine(xs, ys, x1, sx, sy), class: `dymem-line ${line.cls}`,
      'data-line': line.key}, tooltip(line.label)));
    legendLines.push(line);
  }
  if (budget) {
    chart.append(svg('line', {x1: m.l, x2: W - m.r, y1: sy(budget), y2: sy(budget),
      class: 'dymem-line dymem-line-budget', 'data-line': 'budget', 'data-bytes': budget},
    tooltip(`budget ${formatBytes(budget)}`)));
    chart.append(svg('text', {x: W - m.r - 4, y: sy(budget) - 4, class: 'dymem-budget-label',
      'text-anchor': 'end'}, `budget ${formatBytes(budget)}`));
  }
  if (opts.marker) {
    const x = sx(opts.marker.x);
    chart.append(svg('line', {x1: x, x2: x, y1: m.t, y2: H - m.b, class: 'dymem-marker'}));
    chart.append(svg('text', {x: x + 4, y: m.t + 10, class: 'dymem-marker-label'}, opts.marker.label));
  }
  const peakBytes = totals[peakIndex];
  const px = points[peakIndex].x;
  chart.append(svg('circle', {cx: sx(px), cy: sy(peakBytes), r: 3.5, class: 'dymem-peak'}));
  const anchor = sx(px) > W * 0.75 ? 'end' : 'start';
  chart.append(svg('text', {x: sx(px) + (anchor === 'end' ? -6 : 6), y: Math.max(m.t + 10, sy(peakBytes) - 6),
    class: 'dymem-peak-label', 'text-anchor': anchor}, `peak ${formatBytes(peakBytes)}`));
  const figure = el('figure', {class: 'dymem-chart', 'data-source': opts.source, 'data-points': points.length,
    'data-peak-bytes': peakBytes, 'data-peak-x': px, 'data-budget-bytes': budget ?? '', 'data-y-max': yMax});
  figure.append(el('figcaption', {}, opts.title,
      el('span', {class: 'dymem-caption-figure'}, ` · peak ${formatBytes(peakBytes)} ${opts.peakAt(px)}`)));
  figure.append(chart);
  const peakPoint = points[peakIndex];
  figure.append(el('div', {class: 'dymem-legend'},
      groups.map((g) => el('span', {class: 'dymem-legend-item', 'data-group': g},
          el('i', {class: `dymem-swatch dymem-group-${g}`}), `${g} ${formatBytes(peakPoint[g] || 0)} at peak`)),
      legendLines.map((l) => el('span', {class: 'dymem-legend-item', 'data-line': l.key},
          el('i', {class: `dymem-swatch-line ${l.cls}`}), l.label)),
      budget ? el('span', {class: 'dymem-legend-item', 'data-line': 'budget'},
          el('i', {class: 'dymem-swatch-line dymem-line-budget'}), 'budget') : null));
  return figure;
}

function stepArea(xs, lower, upper, xEnd, sx, sy) {
  let d = `M${sx(xs[0])},${sy(upper[0])}`;
  for (let i = 0; i < xs.length; i++) {
    const next = i + 1 < xs.length ? xs[i + 1] : xEnd;
    d += `H${sx(next)}`;
    if (i + 1 < xs.length) d += `V${sy(upper[i + 1])}`;
  }
  d += `V${sy(lower[xs.length - 1])}`;
  for (let i = xs.length - 1; i >= 0; i--) {
    d += `H${sx(xs[i])}`;
    if (i > 0) d += `V${sy(lower[i - 1])}`;
  }
  return d + 'Z';
}

function stepLine(xs, ys, xEnd, sx, sy) {
  let d = '';
  let open = false;
  for (let i = 0; i < xs.length; i++) {
    const y = ys[i];
    if (typeof y !== 'number') {
      open = false;
      continue;
    }
    const next = i + 1 < xs.length ? xs[i + 1] : xEnd;
    d += open ? `V${sy(y)}H${sx(next)}` : `M${sx(xs[i])},${sy(y)}H${sx(next)}`;
    open = true;
  }
  return d || 'M0,0';
}

// A view whose file is absent: nothing to count, and a note unless the reader already reported a problem with it.
function showMissing(section, data, file, text) {
  section.dataset.count = '0';
  if (!(data.messages || []).some((m) => m.file === file)) {
    section.append(message(text, 'info', 'empty'));
  }
}

// ------------------------------------------------------------------------------------------------ pool map
function renderPool(section, data) {
  const pool = data.pool;
  if (!pool) {
    showMissing(section, data, 'trace.csv', 'No allocator trace in this run.');
    return;
  }
  const reservedOverhead = lastDefined(data.steps || [], 'reserved_overhead');
  section.dataset.count = String(pool.blocks.length);
  section.dataset.fragmentation = String(pool.fragmentation);
  const figures = [
    ['in_use_bytes', 'In use at the peak', formatBytes(pool.in_use_bytes), pool.in_use_bytes],
    ['extent_bytes', 'Pool extent', formatBytes(pool.extent_bytes), pool.extent_bytes],
    ['free_bytes', 'Free in gaps', formatBytes(pool.free_bytes), pool.free_bytes],
    ['largest_free_bytes', 'Largest gap', formatBytes(pool.largest_free_bytes), pool.largest_free_bytes],
    ['fragmentation', 'Fragmentation (1 − largest gap / free)', formatPercent(pool.fragmentation),
      pool.fragmentation],
    ['blocks', 'Live buffers', String(pool.blocks.length), pool.blocks.length],
  ];
  if (reservedOverhead !== null) {
    figures.push(['reserved_overhead', 'Reserved overhead (1 − in use / reserved, last step)',
      formatPercent(reservedOverhead), reservedOverhead]);
  }
  section.append(el('p', {class: 'dymem-caption'},
      `Traced buffers live at allocator event ${pool.event} (TensorFlow ${stepName(pool)}), by offset in the pool; ` +
      'gaps are free or hold buffers allocated before the trace started. Hover a block for its op.'));
  section.append(el('dl', {class: 'dymem-figures'}, figures.map(([k, label, text, value]) =>
    el('div', {class: 'dymem-figure', 'data-key': k}, el('dt', {}, label), el('dd', {'data-value': value},
        text)))));
  const extent = Math.max(1, pool.extent_bytes);
  const rows = Math.min(8, Math.max(1, Math.ceil(pool.blocks.length / 12)));
  const W = chartWidth;
  const m = {l: 72, r: 10, t: 6};
  const rowH = 26;
  const gap = 8;
  const H = m.t + rows * (rowH + gap) + 4;
  const perRow = extent / rows;
  const scale = (W - m.l - m.r) / perRow;
  const chart = svg('svg', {viewBox: `0 0 ${W} ${H}`, class: 'dymem-svg dymem-pool-map', role: 'img',
    'aria-label': 'pool map at the peak'});
  for (let r = 0; r < rows; r++) {
    const y = m.t + r * (rowH + gap);
    chart.append(svg('rect', {x: m.l, y, width: W - m.l - m.r, height: rowH, class: 'dymem-pool-row'}));
    chart.append(svg('text', {x: m.l - 6, y: y + rowH / 2 + 4, class: 'dymem-tick', 'text-anchor': 'end'},
        formatBytes(r * perRow)));
  }
  // Pieces of [offset, offset + size) split across rows.
  const pieces = (offset, size) => {
    const out = [];
    let start = offset;
    const end = offset + size;
    while (start < end) {
      const r = Math.min(rows - 1, Math.floor(start / perRow));
      const rowEnd = r === rows - 1 ? Math.max(end, (r + 1) * perRow) : (r + 1) * perRow;
      const stop = Math.min(end, rowEnd);
      out.push({x: m.l + (start - r * perRow) * scale, y: m.t + r * (rowH + gap),
        w: Math.max(0.75, (stop - start) * scale)});
      if (stop <= start) break;
      start = stop;
    }
    return out;
  };
  for (const h of pool.gaps) {
    const g = svg('g', {class: 'dymem-gap', 'data-offset': h.offset, 'data-size': h.size},
        tooltip(`gap of ${formatBytes(h.size)} at offset ${h.offset}: free, or held by a buffer allocated ` +
          'before the trace started'));
    for (const p of pieces(h.offset, h.size)) {
      g.append(svg('rect', {x: p.x, y: p.y, width: p.w, height: rowH, class: 'dymem-free'}));
    }
    chart.append(g);
  }
  for (const b of pool.blocks) {
    const g = svg('g', {class: `dymem-block dymem-group-${b.group}`, 'data-id': b.id, 'data-group': b.group,
      'data-offset': b.offset, 'data-size': b.size, 'data-op': b.op},
    tooltip(`${b.op || '(unknown op)'}\n${formatBytes(b.size)} ${b.group} at offset ${b.offset}`));
    for (const p of pieces(b.offset, b.size)) {
      g.append(svg('rect', {x: p.x, y: p.y, width: p.w, height: rowH}));
    }
    chart.append(g);
  }
  section.append(chart);
  section.append(el('div', {class: 'dymem-legend'},
      GROUPS.filter((g) => pool.blocks.some((b) => b.group === g)).map((g) =>
        el('span', {class: 'dymem-legend-item', 'data-group': g}, el('i', {class: `dymem-swatch dymem-group-${g}`}),
            `${g} ${formatBytes((pool.by_group || {})[g] || 0)}`)),
      el('span', {class: 'dymem-legend-item', 'data-group': 'free'}, el('i', {class: 'dymem-swatch dymem-free'}),
          `free ${formatBytes(pool.free_bytes)}`)));
}

// ------------------------------------------------------------------------------------------------ swap schedule
function renderSchedule(section, data) {
  const sc = data.schedule;
  if (!sc) {
    showMissing(section, data, 'schedule.json', 'No swap schedule in this run.');
    return;
  }
  const swaps = [...sc.swaps].sort((a, b) => a.producer_layer - b.producer_layer ||
    a.tensor.localeCompare(b.tensor));
  const swapIns = swaps.flatMap((s) => s.swap_ins);
  const stalled = swapIns.filter((si) => si.stall_s > 0);
  const totalStall = stalled.reduce((t, si) => t + si.stall_s, 0);
  const bytes = swaps.reduce((t, s) => t + s.bytes, 0);
  section.dataset.count = String(swaps.length);
  section.dataset.stalls = String(stalled.length);
  section.append(el('p', {class: 'dymem-caption dymem-schedule-summary'},
      `${swaps.length} swapped tensors, ${formatBytes(bytes)}, ${swapIns.length} swap-ins` +
      kindNote(swaps) + '; ' +
      `${stalled.length} stalled swap-in${stalled.length === 1 ? '' : 's'} ` +
      `(modelled stall ${formatSeconds(totalStall)}).`));
  if (!swaps.length) {
    const baseline = data.plan && data.plan.policy === 'none';
    section.append(message(baseline ? 'Policy "none": this run swaps nothing (a baseline to compare with).' :
      'The plan swaps nothing: the step fits the budget without swapping, or no tensor is worth swapping.',
    'info', 'empty'));
    return;
  }
  const n = swaps.length;
  const rowH = Math.max(4, Math.min(18, Math.floor(520 / n)));
  const labels = rowH >= 10;
  const W = chartWidth;
  const m = {l: labels ? 230 : 40, r: 12, t: 18, b: 34};
  const H = m.t + n * rowH + m.b;
  const L = Math.max(1, sc.num_layers);
  const sx = (layer) => m.l + (layer / L) * (W - m.l - m.r);
  const chart = svg('svg', {viewBox: `0 0 ${W} ${H}`, class: 'dymem-svg dymem-schedule-chart', role: 'img',
    'aria-label': 'swap schedule'});
  for (const v of niceTicks(L, 10)) {
    chart.append(svg('line', {x1: sx(v), x2: sx(v), y1: m.t, y2: H - m.b, class: 'dymem-grid'}));
    chart.append(svg('text', {x: sx(v), y: H - m.b + 14, class: 'dymem-tick', 'text-anchor': 'middle'},
        formatNumber(v)));
  }
  chart.append(svg('text', {x: (m.l + W - m.r) / 2, y: H - 4, class: 'dymem-axis-label', 'text-anchor': 'middle'},
      'dependency layer'));
  if (sc.first_backward_layer !== null && sc.first_backward_layer !== undefined) {
    const x = sx(sc.first_backward_layer);
    chart.append(svg('line', {x1: x, x2: x, y1: m.t - 8, y2: H - m.b, class: 'dymem-marker'}));
    chart.append(svg('text', {x: x + 4, y: m.t - 6, class: 'dymem-marker-label'}, 'backward pass →'));
  }
  const bar = Math.max(2, rowH - 3);
  swaps.forEach((s, i) => {
    const y = m.t + i * rowH + (rowH - bar) / 2;
    const stall = s.swap_ins.reduce((t, si) => t + (si.stall_s || 0), 0);
    const out = s.swap_out || {};
    const outStart = out.start_layer ?? s.producer_layer;
    const outEnd = Math.max(outStart, out.end_layer ?? outStart + 1);
    const state = s.kind === 'variable';  // optimizer state: in host memory from the step's start to its swap-in
    const weight = s.kind === 'weight';  // a weight: in host memory but for its forward and its backward stay
    const recomputed = s.kind === 'recompute';  // computed again for the backward pass: never in host memory
    const g = svg('g', {class: `dymem-swap${stall > 0 ? ' dymem-stalled' : ''}`, 'data-tensor': s.tensor,
      'data-kind': s.kind || 'tensor',
      'data-bytes': s.bytes, 'data-producer-layer': s.producer_layer, 'data-swap-ins': s.swap_ins.length,
      'data-trigger-layer': s.swap_ins.length ? s.swap_ins[0].trigger_layer : '',
      'data-consumer-layer': s.swap_ins.length ? s.swap_ins[0].consumer_layer : '', 'data-stall-s': stall},
    tooltip(`${s.tensor} (${formatBytes(s.bytes)})` + (recomputed ?
      `\nrecomputed: off the device from layer ${formatNumber(outEnd)}, computed again for the backward pass` :
      weight ?
      `\nweight: in host memory but for its forward and its backward users, back there by layer ` +
        `${formatNumber(outEnd)}` : state ?
      `\noptimizer state: in host memory between its uses, back there by layer ${formatNumber(outEnd)}` :
      `\nproduced at layer ${s.producer_layer}, swapped out by layer ${formatNumber(outEnd)}`) + s.swap_ins.map((si) =>
      `\nswap-in triggered by ${si.trigger_op || '?'} (layer ${si.trigger_layer}) for ` +
        `${(si.consumers || []).slice(0, 3).join(', ')}${(si.consumers || []).length > 3 ? ', …' : ''} ` +
        `(layer ${si.consumer_layer})${si.stall_s > 0 ? `, stalls ${formatSeconds(si.stall_s)}` : ''}`).join('')));
    const inStart = (si) => si.start_layer ?? si.trigger_layer + 1;
    const hostEnd = Math.min(...s.swap_ins.map(inStart), L);
    const firstStayEnd = (si) => si.end_layer ?? si.consumer_start_layer ?? si.consumer_layer + 0.5;
    const hostSpans = recomputed ? [] : weight && s.swap_ins.length === 2 ?
      [[0, inStart(s.swap_ins[0])], [firstStayEnd(s.swap_ins[0]), inStart(s.swap_ins[1])], [outEnd, L]] :
      state ? [[0, hostEnd], [outEnd, L]] : [[outEnd, hostEnd]];
    for (const [a, b] of hostSpans) {
      g.append(svg('rect', {x: sx(a), y: y + bar * 0.3, width: Math.max(0, sx(b) - sx(a)), height: bar * 0.4,
        class: 'dymem-host'}));
    }
    if (!recomputed) {  // a recomputation copies nothing out
      g.append(svg('rect', {x: sx(outStart), y, width: Math.max(1.5, sx(outEnd) - sx(outStart)), height: bar,
        class: 'dymem-swap-out'}));
    }
    for (const si of s.swap_ins) {
      const start = inStart(si);
      const consumerAt = si.consumer_start_layer ?? si.consumer_layer + 0.5;
      const inEnd = si.end_layer ?? consumerAt;
      const stalledIn = si.stall_s > 0;
      const tx = sx(si.trigger_layer + 0.5);
      g.append(svg('line', {x1: tx, x2: tx, y1: y - 1, y2: y + bar + 1, class: 'dymem-trigger'}));
      g.append(svg('rect', {x: sx(start), y, width: Math.max(1.5, sx(inEnd) - sx(start)), height: bar,
        class: `dymem-swap-in${stalledIn ? ' dymem-stall' : ''}`, 'data-stall-s': si.stall_s || 0}));
      const cx = sx(Math.max(consumerAt, inEnd));
      g.append(svg('path', {d: `M${cx},${y}l${bar / 2},${bar / 2}l${-bar / 2},${bar / 2}z`,
        class: `dymem-consumer${stalledIn ? ' dymem-stall' : ''}`}));
    }
    g.append(svg('circle', {cx: sx(s.producer_layer + 0.5), cy: y + bar / 2, r: Math.max(1.5, bar / 3),
      class: 'dymem-producer'}));
    if (labels) {
      const name = s.tensor.length > 30 ? `…${s.tensor.slice(-29)}` : s.tensor;
      g.append(svg('text', {x: m.l - 6, y: y + bar / 2 + 4, class: 'dymem-row-label', 'text-anchor': 'end'},
          `${state ? 'state ' : ''}${name} ${formatBytes(s.bytes)}`));
    }
    chart.append(g);
  });
  section.append(el('div', {class: 'dymem-scroll'}, chart));
  section.append(el('div', {class: 'dymem-legend'},
      el('span', {class: 'dymem-legend-item'}, el('i', {class: 'dymem-swatch dymem-producer'}), 'producer'),
      el('span', {class: 'dymem-legend-item'}, el('i', {class: 'dymem-swatch dymem-swap-out'}), 'swap-out'),
      el('span', {class: 'dymem-legend-item'}, el('i', {class: 'dymem-swatch dymem-host'}), 'in host memory'),
      el('span', {class: 'dymem-legend-item'}, el('i', {class: 'dymem-swatch-tick dymem-trigger'}), 'trigger'),
      el('span', {class: 'dymem-legend-item'}, el('i', {class: 'dymem-swatch dymem-swap-in'}), 'swap-in'),
      el('span', {class: 'dymem-legend-item'}, el('i', {class: 'dymem-swatch dymem-consumer'}), 'consumer'),
      el('span', {class: 'dymem-legend-item'}, el('i', {class: 'dymem-swatch dymem-stall'}), 'stall')));
}

// ------------------------------------------------------------------------------------------------ tensors table
// Ops of a tf.function run under its call op; the prefix is the same for every row, so the table leaves it out.
function shortOp(name) {
  return (name || '').replace(/^StatefulPartitionedCall\//, '') || '(outside any op)';
}

// Columns of the table: buffers of the allocator trace, or (without a trace) tensors of the simulated step.
const TENSOR_COLUMNS = {
  trace: [
    {key: 'size', label: 'Size', num: true, fmt: formatBytes},
    {key: 'group', label: 'Group'},
    {key: 'op', label: 'Allocating op', fmt: shortOp},
    {key: 'offset', label: 'Offset', num: true, fmt: (v) => String(v)},
    {key: 'lifetime', label: 'Lifetime (events)', num: true, fmt: (v) => (v === null ? 'to the end' : String(v))},
    {key: 'swapped', label: 'Swapped', fmt: (v) => (v ? 'yes' : '')},
  ],
  model: [
    {key: 'size', label: 'Size', num: true, fmt: formatBytes},
    {key: 'group', label: 'Group'},
    {key: 'tensor', label: 'Tensor', fmt: shortOp},
    {key: 'op_type', label: 'Op type'},
    {key: 'keras_layer', label: 'Keras layer'},
    {key: 'layer', label: 'Dependency layer', num: true, fmt: (v) => String(v)},
    {key: 'swapped', label: 'Swapped', fmt: (v) => (v ? 'yes' : '')},
  ],
};

function renderTensors(section, data) {
  const t = data.tensors;
  if (!t) {
    section.dataset.count = '0';
    section.append(message('No allocator trace in this run: nothing to list.', 'info', 'empty'));
    return;
  }
  const rows = t.rows.slice();
  const columns = TENSOR_COLUMNS[t.source] || TENSOR_COLUMNS.trace;
  section.dataset.count = String(rows.length);
  section.dataset.total = String(t.count);
  section.dataset.source = t.source;
  const what = t.source === 'model' ? 'tensors are live at the modelled peak (no allocator trace in this run)' :
    'traced buffers are live at the peak';
  section.append(el('p', {class: 'dymem-caption'},
      `${t.count} ${what}, holding ${formatBytes(t.total_bytes)}` +
      (rows.length < t.count ? `; the ${rows.length} largest are listed.` : '.') + ' Click a header to sort.'));
  const table = el('table', {class: 'dymem-tensor-table'});
  const headRow = el('tr');
  const sortState = {key: 'size', dir: -1};
  const tbody = el('tbody');
  const fill = () => {
    const col = columns.find((c) => c.key === sortState.key);
    rows.sort((a, b) => {
      const va = a[col.key];
      const vb = b[col.key];
      let cmp;
      if (col.num) cmp = (va ?? Infinity) - (vb ?? Infinity);
      else cmp = String(va ?? '').localeCompare(String(vb ?? ''));
      return sortState.dir * cmp || b.size - a.size || a.id - b.id;
    });
    tbody.textContent = '';
    rows.forEach((r, i) => {
      const tr = el('tr', {class: `dymem-tensor-row${r.swapped ? ' dymem-swapped' : ''}`, 'data-id': r.id,
        'data-size': r.size, 'data-op': r.op, 'data-group': r.group});
      tr.append(el('td', {class: 'dymem-rank'}, String(i + 1)));
      for (const c of columns) {
        const v = r[c.key];
        const cell = el('td', {'data-key': c.key, 'data-value': v ?? '', class: c.num ? 'dymem-num' : null,
          title: c.key === 'op' || c.key === 'tensor' ? v : null}, c.fmt ? c.fmt(v) : v ?? '');
        if (c.key === 'group') cell.prepend(el('i', {class: `dymem-swatch dymem-group-${v}`}));
        tr.append(cell);
      }
      tbody.append(tr);
    });
    for (const th of headRow.querySelectorAll('th[data-sort-key]')) {
      const active = th.dataset.sortKey === sortState.key;
      th.setAttribute('aria-sort', active ? (sortState.dir > 0 ? 'ascending' : 'descending') : 'none');
    }
    table.dataset.sortKey = sortState.key;
    table.dataset.sortDir = sortState.dir > 0 ? 'asc' : 'desc';
  };
  headRow.append(el('th', {}, '#'));
  for (const c of columns) {
    const th = el('th', {'data-sort-key': c.key, class: 'dymem-sortable', tabindex: 0}, c.label);
    const sort = () => {
      sortState.dir = sortState.key === c.key ? -sortState.dir : (c.num ? -1 : 1);
      sortState.key = c.key;
      fill();
    };
    th.addEventListener('click', sort);
    th.addEventListener('keydown', (e) => {
      if (e.key === 'Enter' || e.key === ' ') {
        e.preventDefault();
        sort();
      }
    });
    headRow.append(th);
  }
  table.append(el('thead', {}, headRow), tbody);
  fill();
  section.append(el('div', {class: 'dymem-scroll dymem-table-scroll'}, table));
}
