// Cluster: every node (name, master badge, memory and disk bars, accelerator, health with reasons and
// remediations, version), nodes that left, and the topology as a graph. Reads only the shell's /state poll.
import { html, Badge, Bar, Section, ago, bytesOf, gb, shortId, nodeName, tagged } from '../ui.js';

const HEALTH_KIND = { healthy: 'ok', degraded: 'warn', unhealthy: 'error' };

function apiAddress(state, nodeId) {
  const port = (state.nodeApiPorts || {})[nodeId];
  if (!port) return null;
  const here = window.location.hostname;
  const loopback = here === 'localhost' || here.startsWith('127.') || here === '[::1]';
  const ifaces = ((state.nodeNetwork || {})[nodeId] || {}).interfaces || [];
  const lan = ifaces.find((i) => i.ipAddress && !i.ipAddress.startsWith('127.') && !i.ipAddress.includes(':'));
  const host = loopback || !lan ? here : lan.ipAddress;
  return `${window.location.protocol}//${host}:${port}/`;  // a cluster serves https everywhere or nowhere
}

function Accelerator({ acc }) {
  if (!acc) return html`<span class="muted">unknown</span>`;
  const vram = acc.vramTotalBytes ? ` · ${Math.round(acc.vramTotalBytes / 2 ** 30)} GB VRAM` : '';
  const util = acc.utilizationRatio != null ? ` · ${Math.round(acc.utilizationRatio * 100)}% busy` : '';
  return html`<span>${acc.vendor === 'cpu' ? 'CPU only' : acc.vendor} (${acc.name})${vram}${util}</span>`;
}

function Health({ health }) {
  if (!health) return html`<${Badge} kind="muted">no health yet<//>`;
  return html`<div class="health">
    <${Badge} kind=${HEALTH_KIND[health.level] || ''}>${health.level}<//>
    ${(health.reasons || []).map((r) => html`<div class="reason">
      <strong>${r.message}</strong><div class="muted">${r.remediation}</div></div>`)}
  </div>`;
}

// The shards this node runs: model, rank/world and the runner's status.
function shardsOn(state, nodeId) {
  const found = [];
  for (const [id, inst] of Object.entries(state.instances || {})) {
    const [, body] = tagged(inst);
    const assign = body.shardAssignments || {};
    const runner = (assign.nodeToRunner || {})[nodeId];
    if (!runner) continue;
    const [, shard] = tagged((assign.runnerToShard || {})[runner]);
    const status = tagged((state.runners || {})[runner])[0].replace('Runner', '') || 'pending';
    found.push({ id, model: assign.modelId, rank: `${shard.deviceRank}/${shard.worldSize}`, status });
  }
  return found;
}

// The limit placement plans against, where it came from, and what is used, kept back and free under it.
function MemoryLimit({ mem }) {
  if (!mem) return null;
  const parts = [`${gb(bytesOf(mem.ramTotal))} limit (${mem.limitSource || 'machine'})`];
  if (mem.ramUsed) parts.push(`${gb(bytesOf(mem.ramUsed))} used`);
  if (mem.ramReserved) parts.push(`${gb(bytesOf(mem.ramReserved))} reserved`);
  parts.push(`${gb(bytesOf(mem.ramAvailable))} free`);
  return html`<dt>memory</dt><dd data-testid="memory-limit">${parts.join(' · ')}</dd>`;
}

function NodeCard({ state, nodeId }) {
  const ident = (state.nodeIdentities || {})[nodeId] || {};
  const mem = (state.nodeMemory || {})[nodeId];
  const disk = (state.nodeDisk || {})[nodeId];
  const sys = (state.nodeSystem || {})[nodeId];
  const isMaster = state.masterNodeId === nodeId;
  const link = apiAddress(state, nodeId);
  const total = mem ? bytesOf(mem.ramTotal) : 0;
  const diskTotal = disk ? bytesOf(disk.total) : 0;
  return html`<article class="card node" data-testid="node-card" data-node-id=${nodeId} data-state="live">
    <header class="card-head">
      <h3>${ident.friendlyName || 'node'} <span class="muted mono">${shortId(nodeId)}</span></h3>
      ${isMaster && html`<${Badge} kind="master" title="the elected master orders every event">master<//>`}
    </header>
    ${mem ? html`<${Bar} label="memory" used=${total - bytesOf(mem.ramAvailable)} total=${total} />`
      : html`<p class="muted">memory not reported yet</p>`}
    ${disk && html`<${Bar} label="disk" used=${diskTotal - bytesOf(disk.available)} total=${diskTotal} />`}
    <dl class="facts">
      <${MemoryLimit} mem=${mem} />
      <dt>accelerator</dt><dd><${Accelerator} acc=${(state.nodeAccelerator || {})[nodeId]} /></dd>
      ${sys && html`<dt>CPU</dt><dd>${Math.round(sys.pcpuUsage || 0)}%</dd>`}
      <dt>version</dt><dd>${ident.skulkVersion || '?'}${ident.skulkCommit ? ` (${ident.skulkCommit})` : ''}</dd>
      <dt>system</dt><dd>${ident.osVersion || '?'} · ${ident.chipId || ''}</dd>
      <dt>health</dt><dd><${Health} health=${(state.nodeHealth || {})[nodeId]} /></dd>
      <dt>runs</dt><dd>${shardsOn(state, nodeId).map((r) => html`<div class="small">
        ${`${r.model} · rank ${r.rank} · ${r.status} `}<span class="muted mono">${shortId(r.id)}</span></div>`)}${shardsOn(state, nodeId).length ? '' : 'nothing'}</dd>
    </dl>
    ${link && html`<a class="small" href=${link}>this node's dashboard</a>`}
  </article>`;
}

function GoneCard({ node }) {
  return html`<article class="card node gone" data-testid="node-card" data-node-id=${node.id} data-state="gone">
    <header class="card-head"><h3>${node.name}</h3><${Badge} kind="error">gone<//></header>
    <p>Left the cluster ${ago(node.goneAt)}. Its instances were deleted; MetaInstances are placed again on the
      nodes that are left.</p>
  </article>`;
}

// "0.42 ms · 940 Mb/s": the link's measured round trip and bandwidth (state.nodeLinks, as either end measured
// it; the slower reading of the two when both did).
export function linkLabel(state, a, b) {
  const links = state.nodeLinks || {};
  const seen = [(links[a] || {})[b], (links[b] || {})[a]].filter(Boolean);
  if (!seen.length) return '';
  const rtt = Math.max(...seen.map((l) => l.rttMs));
  const rates = seen.map((l) => l.bandwidthMbps).filter((v) => v != null);
  const rate = rates.length ? Math.min(...rates) : null;
  const mbps = rate == null ? '' : rate >= 1000 ? ` · ${(rate / 1000).toFixed(1)} Gb/s` : ` · ${Math.round(rate)} Mb/s`;
  return `${rtt < 1 ? rtt.toFixed(2) : rtt.toFixed(1)} ms${mbps}`;
}

// Nodes on a circle, one line per linked pair (dashed when only one direction answers), the master ringed.
export function Topology({ state, gone }) {
  const nodes = [...((state.topology || {}).nodes || [])].sort();
  const all = [...nodes, ...gone.map((g) => g.id)];
  const size = 320;
  const c = size / 2;
  const r = all.length > 1 ? size / 2 - 48 : 0;
  const pos = new Map(all.map((id, i) => {
    const a = (2 * Math.PI * i) / all.length - Math.PI / 2;
    return [id, [c + r * Math.cos(a), c + r * Math.sin(a)]];
  }));
  const links = new Map();
  for (const conn of (state.topology || {}).connections || []) {
    const key = [conn.source, conn.sink].sort().join('|');
    const both = links.has(key) && links.get(key).from !== conn.source;
    links.set(key, { from: conn.source, a: conn.source, b: conn.sink, both: both || (links.get(key) || {}).both });
  }
  const goneIds = new Set(gone.map((g) => g.id));
  const drawn = [...links.values()].filter((l) => pos.has(l.a) && pos.has(l.b));
  return html`<svg class="topology" viewBox=${`0 0 ${size} ${size}`} role="img" data-testid="topology"
      aria-label=${`topology: ${nodes.length} nodes, ${links.size} links`}>
    ${drawn.map((l) => html`<line
      class=${l.both ? 'edge' : 'edge one-way'} x1=${pos.get(l.a)[0]} y1=${pos.get(l.a)[1]}
      x2=${pos.get(l.b)[0]} y2=${pos.get(l.b)[1]} />`)}
    ${drawn.map((l) => {
      const label = linkLabel(state, l.a, l.b);
      const [x1, y1] = pos.get(l.a);
      const [x2, y2] = pos.get(l.b);
      return label && html`<text class="edge-label" data-testid="link-label" x=${(x1 + x2) / 2} y=${(y1 + y2) / 2 - 6}
        text-anchor="middle">${label}<title>${`measured round trip and bandwidth between ${nodeName(state, l.a)} and ${nodeName(state, l.b)}`}</title></text>`;
    })}
    ${all.map((id) => {
      const [x, y] = pos.get(id);
      const cls = goneIds.has(id) ? 'vertex gone' : state.masterNodeId === id ? 'vertex master' : 'vertex';
      const label = goneIds.has(id) ? `${gone.find((g) => g.id === id).name} (gone)` : nodeName(state, id);
      return html`<g class=${cls} data-node-id=${id}><circle cx=${x} cy=${y} r="18" />
        <text x=${x} y=${y + 34} text-anchor="middle">${label}</text></g>`;
    })}
  </svg>`;
}

export function ClusterPage({ state, gone }) {
  const nodes = Object.keys(state.nodeIdentities || {}).sort((a, b) =>
    (b === state.masterNodeId) - (a === state.masterNodeId) || a.localeCompare(b));
  return html`
    <${Section} id="nodes-title" title=${`Nodes (${nodes.length})`}
      actions=${html`<span class="muted">term ${state.term} · event ${state.lastEventAppliedIdx}</span>`}>
      <div class="grid" data-testid="nodes">
        ${nodes.map((id) => html`<${NodeCard} key=${id} state=${state} nodeId=${id} />`)}
        ${gone.map((g) => html`<${GoneCard} key=${g.id} node=${g} />`)}
      </div>
    <//>
    <${Section} id="topology-title" title="Topology">
      <${Topology} state=${state} gone=${gone} />
      <p class="muted small">A line joins two nodes whose APIs reach each other (dashed: one direction only),
        labelled with the round trip and bandwidth the nodes measured. Placement builds rings from these links,
        and its previews predict tok/s from them.</p>
    <//>`;
}
