// Models: the catalog (GET /models) with sizes and families; where each model's files are, per node, with
// progress bars (state.downloads); download, add by Hugging Face id, purge staging; this node's storage.
import { useState } from '../../vendor/hooks.js';
import { request, useAction, usePoll } from '../api.js';
import { html, Badge, Bar, ConfirmButton, ErrorNote, Section, gb, nodeName, pct } from '../ui.js';

const enc = encodeURIComponent;
const modelPath = (id) => id.split('/').map(enc).join('/');

function Progress({ state, nodeId, p }) {
  const fraction = pct(p.downloadedBytes, p.totalBytes);
  const rate = p.bytesPerSecond ? ` · ${(p.bytesPerSecond / 2 ** 20).toFixed(1)} MiB/s` : '';
  return html`<div class="progress-row" data-testid="download-progress">
    <span class="bar-label">${nodeName(state, nodeId)}</span>
    <progress max="100" value=${p.status === 'Completed' ? 100 : fraction}
      aria-label=${`download on ${nodeName(state, nodeId)}`}></progress>
    <span class="bar-text">${p.status} (${p.source}) ${gb(p.downloadedBytes)} of ${gb(p.totalBytes)}${rate}
      ${p.error ? html` · <span class="error-text">${p.error}</span>` : ''}</span>
  </div>`;
}

function ModelRow({ state, model, onChanged }) {
  const [act, run] = useAction();
  const perNode = Object.entries(state.downloads || {})
    .filter(([, models]) => models[model.id]).map(([node, models]) => [node, models[model.id]]);
  const download = () => run(() => request(`/store/models/${modelPath(model.id)}/download`, { method: 'POST', timeout: 30000 }))
    .then(onChanged);
  const purge = () => run(() => request('/store/purge-staging', { method: 'POST', body: { modelId: model.id }, timeout: 60000 }))
    .then(onChanged);
  const here = model.downloaded ? 'downloaded here' : model.staged ? 'staged here' : null;
  return html`<li class="card model" data-testid="model-row" data-model-id=${model.id}>
    <header class="card-head">
      <h3>${model.name} <span class="muted mono">${model.id}</span></h3>
      <span>${model.is_custom && html`<${Badge}>custom<//>`} ${here && html`<${Badge} kind="ok">${here}<//>`}</span>
    </header>
    <p class="muted">${model.family} · ${(model.storage_size_megabytes / 1024).toFixed(2)} GiB on disk ·${' '}
      ${model.quantization === 'none' ? 'unquantized' : model.quantization} · context ${model.context_length}
      ${model.supports_tensor ? ' · Pipeline or Tensor' : ' · Pipeline only'}</p>
    ${perNode.map(([node, p]) => html`<${Progress} state=${state} nodeId=${node} p=${p} />`)}
    <div class="row">
      ${!model.downloaded && !(model.tags || []).includes('builtin') && html`<button type="button" disabled=${act.busy}
        onClick=${download}>Download to the store</button>`}
      <${ConfirmButton} label="Purge staging" question=${`Evict staged copies of ${model.id} on every node?`}
        busy=${act.busy} onConfirm=${purge} />
    </div>
    <${ErrorNote} error=${act.error} />
    ${act.result && act.result.message && html`<p class="muted">${act.result.message}</p>`}
  </li>`;
}

function AddModel({ onAdded }) {
  const [id, setId] = useState('');
  const [act, run] = useAction();
  const submit = (e) => {
    e.preventDefault();
    run(() => request('/models/add', { method: 'POST', body: { model_id: id.trim() }, timeout: 60000 }))
      .then((r) => { if (r) { setId(''); onAdded(); } });
  };
  return html`<form class="row" onSubmit=${submit}>
    <label class="grow">Hugging Face id <input value=${id} placeholder="Qwen/Qwen3-0.6B" required
      pattern="[A-Za-z0-9][\\w.\\-]*/[\\w.\\-]+" onInput=${(e) => setId(e.target.value)} /></label>
    <button type="submit" class="primary" disabled=${act.busy}>${act.busy ? 'Adding…' : 'Add model'}</button>
    <${ErrorNote} error=${act.error} what="not added" />
    ${act.result && html`<p class="muted">Added ${act.result.id}.</p>`}
  </form>`;
}

function Storage({ onPurged }) {
  const [{ data, error }, refresh] = usePoll('/store/storage', 10000);
  const [act, run] = useAction();
  const purgeAll = () => run(() => request('/store/purge-staging', { method: 'POST', body: {}, timeout: 60000 }))
    .then(() => { refresh(); onPurged(); });
  if (error && error.status === 404) return html`<p class="muted">This node has no model store.</p>`;
  return html`<div>
    <${ErrorNote} error=${error} what="storage" />
    ${data && html`<div>
      <${Bar} label="disk" used=${data.disk_total_bytes - data.disk_free_bytes} total=${data.disk_total_bytes} />
      <p>Staged here: ${gb(data.staged_total_bytes)} in ${data.staged_models.length} models
        (kept while idle up to ${data.staging_keep_recent_gb} GB; cleanup on deactivate${' '}
        ${data.cleanup_on_deactivate ? 'on' : 'off'}) · event log ${gb(data.event_log_bytes)} ·${' '}
        <span class="mono small">${data.staging_root}</span></p>
      <ul class="plain">${data.staged_models.map((m) => html`<li><span class="mono">${m.model_id}</span>${' '}
        · ${gb(m.size_bytes)}${m.in_use ? ' · in use' : ''} · last used ${m.last_used_at}</li>`)}</ul>
    </div>`}
    <${ConfirmButton} label="Purge all staging" question="Evict every not-in-use staged model on every node?"
      busy=${act.busy} onConfirm=${purgeAll} />
    <${ErrorNote} error=${act.error} />
    ${act.result && html`<p class="muted">Purge done on ${Object.keys(act.result.nodes || {}).length} node(s).</p>`}
  </div>`;
}

export function ModelsPage({ state, refreshState }) {
  const [{ data, error }, refresh] = usePoll('/models', 5000);
  const changed = () => { refresh(); refreshState(); };
  const models = (data && data.data) || [];
  return html`
    <${Section} id="catalog-title" title=${`Catalog (${models.length})`}>
      <${ErrorNote} error=${error} what="catalog" />
      <ul class="grid plain" data-testid="catalog">
        ${models.map((m) => html`<${ModelRow} key=${m.id} state=${state} model=${m} onChanged=${changed} />`)}
      </ul>
    <//>
    <${Section} id="add-title" title="Add a model by Hugging Face id"><${AddModel} onAdded=${changed} /><//>
    <${Section} id="storage-title" title="Storage on this node"><${Storage} onPurged=${changed} /><//>`;
}
