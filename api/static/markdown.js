// Markdown for model output, built with DOM APIs only: the model's text only
// ever becomes text nodes and checked attribute values, never markup, so an
// answer holding "<script>" or "<img onerror=…>" shows those characters.
//
// What it knows: fenced code blocks (with a copy button), ATX headings, block
// quotes, bullet and numbered lists (nested by indentation), pipe tables,
// horizontal rules, paragraphs; inline code, **strong**, *emphasis*,
// ~~strike~~, [links](https://…) and bare http(s) URLs. A link opens in a new
// tab with rel="noopener noreferrer", and only an http: or https: address
// becomes one: any other ("javascript:", "data:") stays text. An unclosed
// fence runs to the end, so a code block streams as code.
"use strict";

const Markdown = (() => {
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}>\s?/;
  const ITEM = /^( {0,12})([-*+]|\d{1,9}[.)])(\s+|$)(.*)$/;
  const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
  const SAFE_HREF = /^https?:\/\/[^\s]+$/i;
  // One alternative per inline form; the first match wins, scanning left to right.
  const INLINE = new RegExp(
    [
      /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source, // 1, 2: code
      /\[([^\]\n]+)\]\(\s*<?([^\s()<>]+(?:\([^\s()]*\)[^\s()<>]*)*)>?(?:\s+"[^"\n]*")?\s*\)/.source, // 3, 4: link
      /\*\*(?=\S)([\s\S]*?\S)\*\*/.source, // 5: strong
      /(?<![\w])__(?=\S)([\s\S]*?\S)__(?![\w])/.source, // 6: strong
      /~~(?=\S)([\s\S]*?\S)~~/.source, // 7: strike
      /\*(?=[^\s*])([\s\S]*?[^\s*])\*/.source, // 8: emphasis
      /(?<![\w])_(?=[^\s_])([\s\S]*?[^\s_])_(?![\w])/.source, // 9: emphasis
      /\\([!-/:-@[-`{-~])/.source, // 10: escaped punctuation
      /(https?:\/\/[^\s<>"'`]*[^\s<>"'`.,;:!?)\]*_])/.source, // 11: bare URL
    ].join("|"),
    "g"
  );

  function node(tag, className) {
    const n = document.createElement(tag);
    if (className) n.className = className;
    return n;
  }

  function link(href, label) {
    const a = node("a");
    a.href = href;
    a.target = "_blank";
    a.rel = "noopener noreferrer";
    a.append(...label);
    return a;
  }

  /** The inline nodes of ``text``. */
  function inline(text) {
    const out = [];
    let last = 0;
    const re = new RegExp(INLINE.source, "g");
    let m;
    while ((m = re.exec(text)) !== null) {
      if (m.index > last) out.push(document.createTextNode(text.slice(last, m.index)));
      last = m.index + m[0].length;
      if (m[2] !== undefined) {
        const code = node("code");
        code.textContent = m[2].length > 2 && m[2].startsWith(" ") && m[2].endsWith(" ") ? m[2].slice(1, -1) : m[2];
        out.push(code);
      } else if (m[3] !== undefined) {
        if (SAFE_HREF.test(m[4])) out.push(link(m[4], inline(m[3])));
        else out.push(document.createTextNode(m[0]));
      } else if (m[5] !== undefined || m[6] !== undefined) {
        const b = node("strong");
        b.append(...inline(m[5] ?? m[6]));
        out.push(b);
      } else if (m[7] !== undefined) {
        const s = node("del");
        s.append(...inline(m[7]));
        out.push(s);
      } else if (m[8] !== undefined || m[9] !== undefined) {
        const i = node("em");
        i.append(...inline(m[8] ?? m[9]));
        out.push(i);
      } else if (m[10] !== undefined) {
        out.push(document.createTextNode(m[10]));
      } else if (m[11] !== undefined) {
        out.push(link(m[11], [document.createTextNode(m[11])]));
      }
    }
    if (last < text.length) out.push(document.createTextNode(text.slice(last)));
    return out;
  }

  function copyButton(code, codeNode) {
    // The label comes from CSS (data-state), so the answer's textContent stays the model's text.
    const button = node("button", "copy-code");
    button.type = "button";
    button.setAttribute("aria-label", "Copy code");
    button.dataset.state = "idle";
    button.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(code);
        button.dataset.state = "copied";
        button.setAttribute("aria-label", "Copied");
      } catch (err) {
        // No clipboard (a page not served over https or from localhost): select
        // the code so that Ctrl+C copies it.
        const range = document.createRange();
        range.selectNodeContents(codeNode);
        const selection = window.getSelection();
        selection.removeAllRanges();
        selection.addRange(range);
        button.dataset.state = "failed";
        button.setAttribute("aria-label", "Copy failed: the code is selected, press Ctrl+C");
      }
      clearTimeout(button.resetTimer);
      button.resetTimer = setTimeout(() => {
        button.dataset.state = "idle";
        button.setAttribute("aria-label", "Copy code");
      }, 2000);
    });
    return button;
  }

  function codeBlock(lines, lang) {
    const wrap = node("div", "code-block");
    const pre = node("pre");
    const code = node("code");
    const text = lines.join("\n");
    code.textContent = text;
    if (lang) code.dataset.lang = lang;
    pre.append(code);
    wrap.append(copyButton(text, code), pre);
    return wrap;
  }

  function cells(line) {
    let row = line.trim();
    if (row.startsWith("|")) row = row.slice(1);
    if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
    return row.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  function table(head, rule, rows) {
    const aligns = cells(rule).map((c) =>
      c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : ""
    );
    const t = node("table");
    const row = (values, tag) => {
      const tr = node("tr");
      aligns.forEach((align, i) => {
        const cell = node(tag);
        if (align) cell.className = `align-${align}`;
        cell.append(...inline(values[i] ?? ""));
        tr.append(cell);
      });
      return tr;
    };
    const thead = node("thead");
    thead.append(row(cells(head), "th"));
    const tbody = node("tbody");
    for (const r of rows) tbody.append(row(cells(r), "td"));
    t.append(thead, tbody);
    const wrap = node("div", "table-wrap");
    wrap.append(t);
    return wrap;
  }

  function startsBlock(lines, i) {
    const line = lines[i];
    return (
      FENCE.test(line) ||
      HEADING.test(line) ||
      RULE.test(line) ||
      QUOTE.test(line) ||
      ITEM.test(line) ||
      (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-"))
    );
  }

  function paragraph(lines) {
    const p = node("p");
    p.append(...inline(lines.join("\n")));
    return p;
  }

  /** The block nodes of ``lines``. */
  function blocks(lines) {
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) {
        i++;
        continue;
      }
      let m;
      if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const indent = line.length - line.trimStart().length;
        const body = [];
        i++;
        while (i < lines.length && !(lines[i].trim().startsWith(fence) && /^[`~]+$/.test(lines[i].trim()))) {
          body.push(lines[i].slice(Math.min(indent, lines[i].length - lines[i].trimStart().length)));
          i++;
        }
        i++; // the closing fence, or the end
        out.push(codeBlock(body, m[2]));
      } else if ((m = HEADING.exec(line))) {
        const h = node(`h${Math.min(m[1].length + 2, 6)}`);
        h.append(...inline(m[2]));
        out.push(h);
        i++;
      } else if (RULE.test(line)) {
        out.push(node("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && lines[i].trim() && QUOTE.test(lines[i])) inner.push(lines[i++].replace(QUOTE, ""));
        const q = node("blockquote");
        q.append(...blocks(inner));
        out.push(q);
      } else if ((m = ITEM.exec(line))) {
        const [list, next] = listAt(lines, i, m);
        out.push(list);
        i = next;
      } else if (startsBlock(lines, i)) {
        // A table: header row, rule, then rows while they hold a "|".
        const head = line;
        const rule = lines[i + 1];
        const rows = [];
        i += 2;
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(lines[i++]);
        out.push(table(head, rule, rows));
      } else {
        const para = [];
        while (i < lines.length && lines[i].trim() && !startsBlock(lines, i)) para.push(lines[i++]);
        out.push(paragraph(para));
      }
    }
    return out;
  }

  /** The list starting at ``lines[start]`` (matched as ``first``) and the index after it. */
  function listAt(lines, start, first) {
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const list = node(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
    const sibling = (line) => {
      const m = line !== undefined && ITEM.exec(line);
      return Boolean(m) && m[1].length === indent && /\d/.test(m[2]) === ordered;
    };
    let i = start;
    let loose = false;
    const items = [];
    while (i < lines.length) {
      if (!sibling(lines[i])) break;
      const m = ITEM.exec(lines[i]);
      const width = indent + m[2].length + Math.max(1, Math.min(m[3].length, 4));
      const body = [m[4]];
      i++;
      while (i < lines.length) {
        const line = lines[i];
        const lead = line.length - line.trimStart().length;
        if (!line.trim()) {
          // A blank line continues the item only when indented content follows.
          const after = lines.slice(i + 1).find((l) => l.trim());
          if (after !== undefined && after.length - after.trimStart().length >= width) {
            body.push("");
            loose = true;
            i++;
            continue;
          }
          if (sibling(after)) loose = true;
          break;
        }
        if (lead >= width || (lead > indent && ITEM.test(line))) body.push(line.slice(Math.min(lead, width)));
        else if (!startsBlock(lines, i) && lead > indent) body.push(line.trimStart());
        else if (!startsBlock(lines, i) && body[body.length - 1] !== "") body.push(line); // lazy continuation
        else break;
        i++;
      }
      while (i < lines.length && !lines[i].trim() && sibling(lines.slice(i).find((l) => l.trim()))) i++;
      items.push(body);
    }
    for (const body of items) {
      const li = node("li");
      const inner = blocks(body);
      // A tight item's lone paragraph is its text, as in CommonMark.
      for (const child of inner) {
        if (!loose && child.tagName === "P") li.append(...child.childNodes);
        else li.append(child);
      }
      list.append(li);
    }
    return [list, i];
  }

  /** Replace the children of ``target`` with ``source`` rendered. */
  function render(source, target) {
    target.replaceChildren(...blocks(String(source).replace(/\r\n?/g, "\n").split("\n")));
    target.classList.add("markdown");
  }

  return { render, inline };
})();
