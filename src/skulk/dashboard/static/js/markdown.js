// A small Markdown renderer that builds virtual DOM, never HTML strings: model output is untrusted text, so
// it only ever becomes text nodes and a fixed set of elements. Covers what chat answers use: paragraphs,
// headings, lists, quotes, tables (GitHub's pipe tables), fenced code (highlighted, with a copy button),
// inline code, bold, italic and http(s) links. Highlighting is a small tokenizer here, not a library: the
// maintained ones (highlight.js, Prism) return HTML strings, which this page never inserts.
import { h } from '../vendor/preact.js';
import { useState } from '../vendor/hooks.js';

const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*\n]+)\*\*|__([^_\n]+)__|\*([^*\s][^*\n]*)\*|_([^_\s][^_\n]*)_|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

function safeHref(url) {
  try {
    const parsed = new URL(url, window.location.href);
    return ['http:', 'https:', 'mailto:'].includes(parsed.protocol) ? parsed.href : null;
  } catch { return null; }
}

export function inline(text) {
  const out = [];
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) out.push(text.slice(last, m.index));
    if (m[1]) out.push(h('code', null, m[2]));
    else if (m[3] || m[4]) out.push(h('strong', null, inline(m[3] || m[4])));
    else if (m[5] || m[6]) out.push(h('em', null, inline(m[5] || m[6])));
    else {
      const href = safeHref(m[8]);
      out.push(href ? h('a', { href, target: '_blank', rel: 'noopener noreferrer' }, inline(m[7])) : m[0]);
    }
    last = m.index + m[0].length;
  }
  if (last < text.length) out.push(text.slice(last));
  return out;
}

function withBreaks(lines) {
  const out = [];
  lines.forEach((line, i) => { if (i) out.push(h('br', null)); out.push(...inline(line)); });
  return out;
}

// One pass over the code: comments, strings, numbers and the keywords of the common languages become spans.
const TOKENS = /(\/\/[^\n]*|\/\*[\s\S]*?\*\/|#[^\n]*|--[^\n]*)|("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|(\b\d[\d_]*(?:\.\d+)?(?:e[+-]?\d+)?\b|\b0x[\da-f]+\b)|\b(and|as|async|await|break|case|catch|class|const|continue|def|default|defer|do|elif|else|enum|except|export|extends|false|False|finally|fn|for|from|func|function|go|if|impl|import|in|interface|is|lambda|let|loop|match|mod|mut|new|nil|None|not|null|or|package|pass|pub|raise|return|self|static|struct|switch|this|throw|trait|true|True|try|type|typeof|use|var|void|while|with|yield)\b/gi;
const HASH_COMMENTS = new Set(['', 'py', 'python', 'sh', 'bash', 'shell', 'zsh', 'yaml', 'yml', 'toml', 'rb', 'ruby',
  'r', 'perl', 'make', 'makefile', 'dockerfile', 'ini', 'conf']);
const DASH_COMMENTS = new Set(['sql', 'lua', 'haskell', 'hs']);
const TOKEN_CLASS = ['tok-com', 'tok-str', 'tok-num', 'tok-kw'];

export function highlight(code, lang = '') {
  const language = lang.toLowerCase();
  const out = [];
  let last = 0;
  for (const m of code.matchAll(TOKENS)) {
    const kind = [1, 2, 3, 4].find((g) => m[g] !== undefined) - 1;
    const comment = m[1];
    if (comment && ((comment.startsWith('#') && !HASH_COMMENTS.has(language))
      || (comment.startsWith('--') && !DASH_COMMENTS.has(language)))) continue;  // C's #include, a -- in text
    if (m.index > last) out.push(code.slice(last, m.index));
    out.push(h('span', { class: TOKEN_CLASS[kind] }, m[0]));
    last = m.index + m[0].length;
  }
  if (last < code.length) out.push(code.slice(last));
  return out;
}

function CodeBlock({ code, lang }) {
  const [copied, setCopied] = useState(false);
  const copy = () => {
    const done = () => { setCopied(true); setTimeout(() => setCopied(false), 1500); };
    if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(code).then(done, () => {});
    else {  // plain http on a LAN address: no Clipboard API; the selection way still works
      const area = document.createElement('textarea');
      area.value = code;
      document.body.appendChild(area);
      area.select();
      try { document.execCommand('copy'); done(); } finally { area.remove(); }
    }
  };
  return h('div', { class: 'code-block' },
    h('div', { class: 'code-head' }, h('span', { class: 'muted small' }, lang || 'code'),
      h('button', { type: 'button', class: 'link small', onClick: copy, 'data-testid': 'copy-code' },
        copied ? 'Copied' : 'Copy')),
    h('pre', { class: 'code', 'data-lang': lang || undefined }, h('code', null, highlight(code, lang))));
}

// GitHub's pipe tables: a header row, a |---|:--:| row, then body rows; cells hold inline Markdown.
const TABLE_RULE = /^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$/;
const cells = (line) => line.trim().replace(/^\|/, '').replace(/\|$/, '').split(/(?<!\\)\|/)
  .map((c) => c.trim().replace(/\\\|/g, '|'));

const tableAt = (lines, i) => lines[i].includes('|') && i + 1 < lines.length && lines[i + 1].includes('|')
  && TABLE_RULE.test(lines[i + 1]);

function table(header, rule, rows) {
  const side = (c) => (c.endsWith(':') ? 'right' : c.startsWith(':') ? 'left' : null);
  const aligns = cells(rule).map((c) => (c.startsWith(':') && c.endsWith(':') ? 'center' : side(c)));
  const cell = (tag, text, i) => h(tag, { style: aligns[i] ? `text-align:${aligns[i]}` : undefined }, inline(text));
  const width = cells(header).length;
  const row = (line, tag) => h('tr', null, cells(line).slice(0, width).map((c, i) => cell(tag, c, i)));
  return h('div', { class: 'table-wrap' }, h('table', { class: 'md-table' },
    h('thead', null, row(header, 'th')), h('tbody', null, rows.map((r) => row(r, 'td')))));
}

const FENCE = /^\s{0,3}(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^\s{0,3}\d{1,9}[.)]\s+(.*)$/;
const QUOTE = /^\s{0,3}>\s?(.*)$/;

function takeWhile(lines, i, re) {
  const items = [];
  while (i < lines.length && re.test(lines[i])) { items.push(lines[i].match(re)[1]); i += 1; }
  return [items, i];
}

// Block structure, line by line; an unclosed fence (a stream still arriving) runs to the end.
export function markdown(text) {
  const lines = String(text).replace(/\r\n?/g, '\n').split('\n');
  const blocks = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) { body.push(lines[i]); i += 1; }
      i += 1;
      blocks.push(h(CodeBlock, { code: body.join('\n'), lang: fence[2] }));
      continue;
    }
    if (tableAt(lines, i)) {
      const rule = lines[i + 1];
      i += 2;
      const rows = [];
      while (i < lines.length && lines[i].includes('|') && lines[i].trim()) { rows.push(lines[i]); i += 1; }
      blocks.push(table(line, rule, rows));
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      blocks.push(h(`h${Math.min(6, heading[1].length + 2)}`, null, inline(heading[2])));
      i += 1;
      continue;
    }
    let items;
    if (BULLET.test(line)) {
      [items, i] = takeWhile(lines, i, BULLET);
      blocks.push(h('ul', null, items.map((it) => h('li', null, inline(it)))));
      continue;
    }
    if (NUMBERED.test(line)) {
      [items, i] = takeWhile(lines, i, NUMBERED);
      blocks.push(h('ol', null, items.map((it) => h('li', null, inline(it)))));
      continue;
    }
    if (QUOTE.test(line)) {
      [items, i] = takeWhile(lines, i, QUOTE);
      blocks.push(h('blockquote', null, withBreaks(items)));
      continue;
    }
    if (!line.trim()) { i += 1; continue; }
    const para = [];
    while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i])
      && !BULLET.test(lines[i]) && !NUMBERED.test(lines[i]) && !QUOTE.test(lines[i]) && !tableAt(lines, i)) {
      para.push(lines[i]);
      i += 1;
    }
    blocks.push(h('p', null, withBreaks(para)));
  }
  return blocks;
}
