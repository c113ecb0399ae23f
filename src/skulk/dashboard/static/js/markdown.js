// A small Markdown renderer that builds virtual DOM, never HTML strings: model output is untrusted text, so
// it only ever becomes text nodes and a fixed set of elements. Covers what chat answers use: paragraphs,
// headings, lists, quotes, fenced code, inline code, bold, italic and http(s) links.
import { h } from '../vendor/preact.js';

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
      blocks.push(h('pre', { class: 'code', 'data-lang': fence[2] || undefined },
        h('code', null, body.join('\n'))));
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
      && !BULLET.test(lines[i]) && !NUMBERED.test(lines[i]) && !QUOTE.test(lines[i])) {
      para.push(lines[i]);
      i += 1;
    }
    blocks.push(h('p', null, withBreaks(para)));
  }
  return blocks;
}
