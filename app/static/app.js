/*
 * ragspec web page: upload documents, follow their indexing, ask questions and read the streamed
 * answer with its sources and decoding statistics.
 *
 * Plain DOM code, no framework and no build step. Text from the server or the user is only ever put
 * into the page through textContent / text nodes / attribute setters, never parsed as HTML.
 * All URLs are relative, so the page also works behind a reverse proxy under a path prefix.
 */
(function () {
  'use strict';

  const KEY_STORAGE = 'ragspec.apiKey';
  const SETTINGS_STORAGE = 'ragspec.askSettings';
  const POLL_MS = 700;
  const HEALTH_MS = 30000;
  const PENDING = new Set(['queued', 'indexing', 'uploading']);

  const state = {
    apiKey: '',
    docs: new Map(), // id -> normalized document (uploads in flight use a local "upload-N" id)
    selected: new Set(),
    collection: null, // the collection questions go to (collections.js): {id, name, ready, pending}; null: the ticked documents
    autoSelect: new Set(), // ids uploaded here: ticked once they are ready
    sessionId: newSessionId(),
    turns: 0,
    controller: null,
    pollTimer: null,
    uploadSeq: 0,
    labelSeq: 0,
    turnSeq: 0, // numbers the turns shown, for the anchors of their sources
  };

  // ---------------------------------------------------------------------------------------------
  // small helpers

  function $(id) {
    return document.getElementById(id);
  }

  /** Create an element; `text` sets textContent, other props are attributes; children are nodes or strings. */
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    if (props) {
      for (const [key, value] of Object.entries(props)) {
        if (value === undefined || value === null || value === false) {
          continue;
        }
        if (key === 'text') {
          node.textContent = String(value);
        } else if (key === 'class') {
          node.className = value;
        } else {
          node.setAttribute(key, value === true ? '' : String(value));
        }
      }
    }
    for (const child of children) {
      if (child !== undefined && child !== null) {
        node.append(child); // strings become text nodes
      }
    }
    return node;
  }

  function newSessionId() {
    const c = globalThis.crypto;
    if (c && typeof c.randomUUID === 'function') {
      return c.randomUUID(); // secure contexts (https, localhost)
    }
    const bytes = new Uint8Array(16);
    if (c && typeof c.getRandomValues === 'function') {
      c.getRandomValues(bytes);
    } else {
      for (let i = 0; i < bytes.length; i++) {
        bytes[i] = Math.floor(Math.random() * 256);
      }
    }
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    const hex = Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
    return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
  }

  function url(path) {
    return new URL(path, document.baseURI).toString();
  }

  function authHeaders(extra) {
    const headers = new Headers(extra || {});
    if (state.apiKey) {
      headers.set('Authorization', `Bearer ${state.apiKey}`);
    }
    return headers;
  }

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  /** The service answers errors as {"error": {"code", "message"}}; be tolerant of other shapes. */
  function errorFromBody(status, body, fallbackText) {
    let code = `http_${status}`;
    let message = fallbackText || `HTTP ${status}`;
    if (body && typeof body === 'object') {
      const err = body.error;
      if (err && typeof err === 'object') {
        code = err.code || code;
        message = err.message || message;
      } else if (typeof err === 'string') {
        message = err;
      } else if (body.detail !== undefined) {
        message = typeof body.detail === 'string' ? body.detail : JSON.stringify(body.detail);
      }
    }
    if (status === 401 || status === 403) {
      message = `${message} — check the API key at the top of the page.`;
    }
    return new ApiError(status, code, message);
  }

  async function errorFromResponse(response) {
    const text = await response.text().catch(() => '');
    let body = null;
    try {
      body = text ? JSON.parse(text) : null;
    } catch (_) {
      body = null;
    }
    return errorFromBody(response.status, body, text.slice(0, 300) || response.statusText);
  }

  async function api(method, path, jsonBody) {
    const init = { method, headers: authHeaders({ Accept: 'application/json' }) };
    if (jsonBody !== undefined) {
      init.headers.set('Content-Type', 'application/json');
      init.body = JSON.stringify(jsonBody);
    }
    const response = await fetch(url(path), init);
    if (!response.ok) {
      throw await errorFromResponse(response);
    }
    if (response.status === 204) {
      return null;
    }
    const text = await response.text();
    return text ? JSON.parse(text) : null;
  }

  function clamp01(x) {
    const n = Number(x);
    if (!Number.isFinite(n)) {
      return 0;
    }
    return Math.min(1, Math.max(0, n));
  }

  function isNum(value) {
    return value !== null && value !== undefined && value !== '' && Number.isFinite(Number(value));
  }

  function plural(n, word) {
    return `${n.toLocaleString()} ${word}${n === 1 ? '' : 's'}`;
  }

  function formatBytes(n) {
    if (n < 1024) {
      return `${n} B`;
    }
    if (n < 1024 * 1024) {
      return `${(n / 1024).toFixed(1)} KB`;
    }
    return `${(n / 1024 / 1024).toFixed(1)} MB`;
  }

  function fmt(value, digits) {
    const n = Number(value);
    return value === null || value === undefined || !Number.isFinite(n) ? '–' : n.toFixed(digits);
  }

  // ---------------------------------------------------------------------------------------------
  // health and API key

  async function checkHealth() {
    const node = $('health');
    try {
      const response = await fetch(url('healthz'), { headers: { Accept: 'application/json' } });
      node.dataset.state = response.ok ? 'ok' : 'down';
      node.textContent = response.ok ? 'service up' : `service unhealthy (HTTP ${response.status})`;
    } catch (_) {
      node.dataset.state = 'down';
      node.textContent = 'service unreachable';
    }
  }

  function loadApiKey() {
    try {
      state.apiKey = localStorage.getItem(KEY_STORAGE) || '';
    } catch (_) {
      state.apiKey = '';
    }
    $('api-key').value = state.apiKey;
  }

  function saveApiKey(event) {
    event.preventDefault();
    const value = $('api-key').value.trim();
    state.apiKey = value;
    try {
      if (value) {
        localStorage.setItem(KEY_STORAGE, value);
      } else {
        localStorage.removeItem(KEY_STORAGE);
      }
    } catch (_) {
      /* storage disabled: keep the key for this page only */
    }
    // A key is a tenant: its documents and conversations differ.
    state.docs.clear();
    state.selected.clear();
    newConversation();
    refreshDocuments();
  }

  // ---------------------------------------------------------------------------------------------
  // documents

  function normalizeDoc(raw) {
    const doc = raw && typeof raw === 'object' ? raw : {};
    const id = String(doc.id ?? doc.document_id ?? '');
    return {
      id,
      title: String(doc.title || doc.filename || doc.name || id || 'untitled'),
      status: String(doc.status || 'queued'),
      progress: clamp01(doc.progress),
      message: doc.message ? String(doc.message) : '',
      pages: doc.pages ?? doc.n_pages ?? null,
      chunks: doc.chunks ?? doc.n_chunks ?? doc.num_chunks ?? null,
      tokens: doc.tokens ?? doc.n_tokens ?? doc.num_tokens ?? null,
      sizeBytes: doc.size_bytes ?? null,
      local: false,
    };
  }

  function docListFromBody(body) {
    if (Array.isArray(body)) {
      return body;
    }
    if (body && typeof body === 'object') {
      for (const key of ['documents', 'data', 'items']) {
        if (Array.isArray(body[key])) {
          return body[key];
        }
      }
    }
    return [];
  }

  async function refreshDocuments() {
    const asked = performance.now();
    try {
      const body = await api('GET', 'v1/documents');
      const fresh = new Map();
      for (const raw of docListFromBody(body)) {
        const doc = normalizeDoc(raw);
        if (doc.id) {
          fresh.set(doc.id, doc);
        }
      }
      for (const [id, doc] of state.docs) {
        // uploads still in flight or failed before reaching the server, and uploads the server accepted after
        // this list was asked for (a list answered late must not drop them)
        if (doc.local || (!fresh.has(id) && doc.uploadedAt > asked)) {
          fresh.set(id, doc);
        }
      }
      state.docs = fresh;
      for (const id of [...state.selected]) {
        if (!fresh.has(id)) {
          state.selected.delete(id);
        }
      }
      setDocError('');
    } catch (err) {
      setDocError(`Could not list documents: ${err.message}`);
    }
    renderDocs();
    schedulePoll();
  }

  function setDocError(message) {
    const empty = $('doc-empty');
    empty.classList.toggle('error', Boolean(message));
    empty.dataset.error = message ? '1' : '';
    if (message) {
      empty.textContent = message;
      empty.hidden = false;
    } else {
      empty.textContent = 'No documents yet.';
    }
  }

  /** A document the server has just accepted (202): listed, ticked once ready, followed until indexed. */
  function addUploaded(body, fallbackTitle) {
    const doc = normalizeDoc(body);
    if (!doc.title || doc.title === doc.id) {
      doc.title = fallbackTitle;
    }
    doc.uploadedAt = performance.now();
    state.autoSelect.add(doc.id);
    upsertDoc(doc);
    renderDocs();
    schedulePoll();
  }

  function upsertDoc(doc) {
    const previous = state.docs.get(doc.id);
    if (previous && previous.uploadedAt && !doc.uploadedAt) {
      doc.uploadedAt = previous.uploadedAt; // a later read of the document keeps when the server accepted it
    }
    state.docs.set(doc.id, doc);
    if (doc.status === 'ready' && state.autoSelect.has(doc.id)) {
      state.autoSelect.delete(doc.id);
      state.selected.add(doc.id);
    }
    if (!previous || previous.status !== doc.status || previous.progress !== doc.progress ||
        previous.message !== doc.message || previous.title !== doc.title) {
      renderDocs();
    }
  }

  function docItem(id) {
    for (const li of $('doc-list').children) {
      if (li.dataset.id === id) {
        return li;
      }
    }
    return null;
  }

  function renderDocs() {
    const list = $('doc-list');
    const template = $('doc-item-template');
    const seen = new Set();
    for (const doc of state.docs.values()) {
      seen.add(doc.id);
      let li = docItem(doc.id);
      if (!li) {
        li = template.content.firstElementChild.cloneNode(true);
        li.dataset.id = doc.id;
        const checkId = `doc-check-${++state.labelSeq}`;
        const check = li.querySelector('.doc-check');
        check.id = checkId;
        li.querySelector('.doc-title').setAttribute('for', checkId);
        check.addEventListener('change', () => {
          if (check.checked) {
            state.selected.add(li.dataset.id);
          } else {
            state.selected.delete(li.dataset.id);
          }
          state.autoSelect.delete(li.dataset.id);
          if (check.checked) {
            // ticking a document means asking the ticked documents (collections.js takes the choice back)
            document.dispatchEvent(new CustomEvent('ragspec:ticked'));
          }
          renderAskTarget();
        });
        li.querySelector('.doc-delete').addEventListener('click', (ev) => onDeleteClick(ev, li.dataset.id));
        list.append(li);
      }
      fillDocItem(li, doc);
    }
    for (const li of [...list.children]) {
      if (!seen.has(li.dataset.id)) {
        li.remove();
      }
    }
    const empty = $('doc-empty');
    if (empty.dataset.error !== '1') {
      empty.hidden = state.docs.size > 0;
    }
    renderAskTarget();
  }

  function readyTicked() {
    return [...state.selected].filter((id) => state.docs.get(id)?.status === 'ready');
  }

  /** What the next question asks, said above the question box: one collection, or the ticked documents. */
  function renderAskTarget() {
    const line = $('ask-target');
    const c = state.collection;
    if (c) {
      const pending = Number(c.pending) || 0;
      line.textContent = `Asking: collection “${c.name}” (${plural(Number(c.ready) || 0, 'document')}` +
        `${pending ? `, ${pending.toLocaleString()} still indexing` : ''})`;
      line.dataset.target = 'collection';
      $('question').placeholder = `Ask the collection “${c.name}” (Ctrl+Enter to send)`;
      $('doc-list-help').textContent = 'Questions go to the collection chosen above; tick documents to ask them instead.';
    } else {
      const n = readyTicked().length;
      line.textContent = n ? `Asking: the ticked documents (${plural(n, 'document')})`
        : 'Asking: the ticked documents (none ticked yet)';
      line.dataset.target = 'documents';
      $('question').placeholder = 'Ask about the ticked documents (Ctrl+Enter to send)';
      $('doc-list-help').textContent = 'Tick the documents to ask about.';
    }
  }

  function fillDocItem(li, doc) {
    li.dataset.status = doc.status;
    const ready = doc.status === 'ready';
    const check = li.querySelector('.doc-check');
    check.disabled = !ready;
    check.checked = ready && state.selected.has(doc.id);
    check.setAttribute('aria-label', `Ask about ${doc.title}`);

    fillDocStatus(li, doc);

    const details = [];
    if (ready) {
      if (doc.pages !== null && doc.pages !== undefined) {
        details.push(plural(Number(doc.pages), 'page'));
      }
      if (doc.chunks !== null && doc.chunks !== undefined) {
        details.push(plural(Number(doc.chunks), 'chunk'));
      }
      if (doc.tokens !== null && doc.tokens !== undefined) {
        details.push(plural(Number(doc.tokens), 'token'));
      }
      if (isNum(doc.sizeBytes)) {
        details.push(formatBytes(Number(doc.sizeBytes)));
      }
    }
    const message = li.querySelector('.doc-message');
    const text = doc.status === 'failed'
      ? (doc.message || 'Indexing failed.')
      : [doc.message, details.join(' · ')].filter(Boolean).join(' — ');
    message.textContent = text;
    message.hidden = !text;
    message.classList.toggle('error', doc.status === 'failed');
    message.setAttribute('role', doc.status === 'failed' ? 'alert' : 'status');

    const del = li.querySelector('.doc-delete');
    del.disabled = doc.status === 'uploading';
    if (del.dataset.armed !== '1') {
      del.textContent = doc.local ? 'Dismiss' : 'Delete';
    }
    del.setAttribute('aria-label', `${doc.local ? 'Dismiss' : 'Delete'} ${doc.title}`);
  }


  // Two-step delete instead of a modal confirm(): the first click arms the button (true: stop there), a
  // second click within a few seconds goes ahead.
  function armDelete(button) {
    if (button.dataset.armed === '1') return false;
    button.dataset.armed = '1';
    button.textContent = 'Confirm delete';
    setTimeout(() => {
      if (button.isConnected && button.dataset.armed === '1') {
        button.dataset.armed = '';
        button.textContent = 'Delete';
      }
    }, 4000);
    return true;
  }
  async function onDeleteClick(event, id) {
    const button = event.currentTarget;
    const doc = state.docs.get(id);
    if (!doc) {
      return;
    }
    if (doc.local) {
      state.docs.delete(id);
      renderDocs();
      return;
    }
    if (armDelete(button)) return;
    button.dataset.armed = '';
    button.disabled = true;
    try {
      await api('DELETE', `v1/documents/${encodeURIComponent(id)}`);
      state.docs.delete(id);
      state.selected.delete(id);
      renderDocs();
    } catch (err) {
      if (err.status === 404) {
        state.docs.delete(id);
        state.selected.delete(id);
        renderDocs();
      } else {
        upsertDoc({ ...doc, message: `Delete failed: ${err.message}` });
        button.disabled = false;
        button.textContent = 'Delete';
      }
    }
  }

  function schedulePoll() {
    if (state.pollTimer !== null) {
      return;
    }
    const pending = [...state.docs.values()].some((d) => !d.local && PENDING.has(d.status));
    if (pending) {
      state.pollTimer = setTimeout(pollPending, POLL_MS);
    }
  }

  async function pollPending() {
    state.pollTimer = null;
    const pending = [...state.docs.values()].filter((d) => !d.local && PENDING.has(d.status));
    await Promise.all(pending.map(async (doc) => {
      try {
        const body = await api('GET', `v1/documents/${encodeURIComponent(doc.id)}`);
        if (!state.docs.has(doc.id)) {
          return; // deleted while the request was in flight
        }
        const fresh = normalizeDoc(body);
        if (!fresh.id) {
          fresh.id = doc.id;
        }
        upsertDoc(fresh);
      } catch (err) {
        if (err.status === 404) {
          state.docs.delete(doc.id);
          renderDocs();
        } else {
          upsertDoc({ ...doc, message: `Status check failed: ${err.message}` });
        }
      }
    }));
    schedulePoll();
  }

  /** Multipart upload through XMLHttpRequest, which (unlike fetch) reports upload progress. */
  function uploadFile(file) {
    const localId = `upload-${++state.uploadSeq}`;
    const placeholder = {
      id: localId, title: file.name, status: 'uploading', progress: 0, message: 'Uploading…',
      pages: null, chunks: null, tokens: null, local: true,
    };
    state.docs.set(localId, placeholder);
    renderDocs();

    const form = new FormData();
    form.append('file', file, file.name);
    const xhr = new XMLHttpRequest();
    xhr.open('POST', url('v1/documents'));
    xhr.setRequestHeader('Accept', 'application/json');
    if (state.apiKey) {
      xhr.setRequestHeader('Authorization', `Bearer ${state.apiKey}`);
    }
    xhr.upload.addEventListener('progress', (ev) => {
      if (ev.lengthComputable && state.docs.has(localId)) {
        upsertDoc({ ...state.docs.get(localId), progress: ev.total ? ev.loaded / ev.total : 0 });
      }
    });
    xhr.addEventListener('load', () => {
      let body = null;
      try {
        body = xhr.responseText ? JSON.parse(xhr.responseText) : null;
      } catch (_) {
        body = null;
      }
      state.docs.delete(localId);
      if (xhr.status >= 200 && xhr.status < 300 && body) {
        addUploaded(body, file.name);
      } else {
        const err = errorFromBody(xhr.status, body, xhr.statusText);
        state.docs.set(localId, { ...placeholder, status: 'failed', message: `Upload failed: ${err.message}` });
        renderDocs();
      }
    });
    const onNetworkError = () => {
      state.docs.set(localId, { ...placeholder, status: 'failed', message: 'Upload failed: network error.' });
      renderDocs();
    };
    xhr.addEventListener('error', onNetworkError);
    xhr.addEventListener('abort', onNetworkError);
    xhr.send(form);
  }

  function uploadFiles(files) {
    for (const file of files) {
      uploadFile(file);
    }
  }

  async function onPasteSubmit(event) {
    event.preventDefault();
    const text = $('paste-text').value;
    const typedTitle = $('paste-title').value.trim();
    const title = typedTitle || 'Pasted text'; // the service titles untitled text by its first line
    if (!text.trim()) {
      $('paste-text').focus();
      return;
    }
    const button = event.submitter || $('paste-form').querySelector('button');
    button.disabled = true;
    try {
      const body = await api('POST', 'v1/documents', typedTitle ? { text, title: typedTitle } : { text });
      addUploaded(body, title);
      $('paste-text').value = '';
      $('paste-title').value = '';
    } catch (err) {
      const localId = `upload-${++state.uploadSeq}`;
      state.docs.set(localId, {
        id: localId, title, status: 'failed', progress: 0, message: `Upload failed: ${err.message}`,
        pages: null, chunks: null, tokens: null, local: true,
      });
      renderDocs();
    } finally {
      button.disabled = false;
    }
  }

  // A document row's title, status badge and indexing progress (the library's rows and a collection's alike).
  function fillDocStatus(li, doc) {
    const title = li.querySelector('.doc-title');
    title.textContent = doc.title;
    title.title = doc.title;

    const badge = li.querySelector('.doc-status');
    badge.textContent = doc.status;
    badge.dataset.status = doc.status;

    const progress = li.querySelector('.doc-progress');
    const percent = li.querySelector('.doc-percent');
    const pending = PENDING.has(doc.status);
    progress.hidden = !pending;
    percent.hidden = !pending;
    progress.setAttribute('aria-label', `${doc.status} ${doc.title}`);
    if (doc.status === 'queued' || (doc.status === 'uploading' && doc.progress === 0)) {
      progress.removeAttribute('value'); // indeterminate
      percent.textContent = '';
    } else {
      progress.value = doc.progress;
      percent.textContent = `${Math.round(doc.progress * 100)}%`;
    }
  }

  // A drop zone with its file input: chosen or dropped files go to onFiles (an array, never empty).
  function wireDropZone(zone, input, onFiles) {
    input.addEventListener('change', () => {
      if (input.files && input.files.length) {
        onFiles([...input.files]);
      }
      input.value = '';
    });
    for (const type of ['dragenter', 'dragover']) {
      zone.addEventListener(type, (ev) => {
        ev.preventDefault();
        if (ev.dataTransfer) {
          ev.dataTransfer.dropEffect = 'copy';
        }
        zone.classList.add('dragging');
      });
    }
    zone.addEventListener('dragleave', (ev) => {
      if (!zone.contains(ev.relatedTarget)) {
        zone.classList.remove('dragging');
      }
    });
    zone.addEventListener('drop', (ev) => {
      ev.preventDefault();
      zone.classList.remove('dragging');
      const files = ev.dataTransfer ? [...ev.dataTransfer.files] : [];
      if (files.length) {
        onFiles(files);
      }
    });
  }

  function setupDropZone() {
    const zone = $('drop-zone');
    wireDropZone(zone, $('file-input'), uploadFiles);
    // A file dropped next to the zone must not make the browser navigate away from the page.
    for (const type of ['dragover', 'drop']) {
      window.addEventListener(type, (ev) => {
        if (!zone.contains(ev.target)) {
          ev.preventDefault();
        }
      });
    }
  }

  // ---------------------------------------------------------------------------------------------
  // asking

  // Citations and highlights come from the server (app/answering/citations.py): spans are [start, end) offsets in
  // Unicode code points (Python string indices), so texts are sliced as arrays of code points here.

  /** `text` as a fragment with the spans [start, end) (whole words, chosen by the server) in <mark>. */
  function highlighted(text, spans) {
    const chars = Array.from(text);
    const fragment = document.createDocumentFragment();
    let last = 0;
    const sorted = (Array.isArray(spans) ? spans : [])
      .filter((s) => Array.isArray(s) && isNum(s[0]) && isNum(s[1]))
      .map((s) => [Math.max(0, Number(s[0])), Math.min(chars.length, Number(s[1]))])
      .sort((a, b) => a[0] - b[0]);
    for (const [start, end] of sorted) {
      if (start < last || end <= start) {
        continue; // overlapping or empty: keep the first
      }
      if (start > last) {
        fragment.append(chars.slice(last, start).join(''));
      }
      fragment.append(el('mark', { class: 'support', text: chars.slice(start, end).join('') }));
      last = end;
    }
    if (last < chars.length) {
      fragment.append(chars.slice(last).join(''));
    }
    return fragment;
  }

  function sourceAnchor(turn, n) {
    return `src-${turn.dataset.turnId}-${n}`;
  }

  /** Open source `n` (1-based) of the turn and bring it into view. */
  function showSource(turn, n) {
    const item = turn.ownerDocument.getElementById(sourceAnchor(turn, n));
    if (!item) {
      return;
    }
    item.querySelector('details').open = true;
    item.scrollIntoView({ block: 'nearest' });
    item.querySelector('summary').focus();
  }

  /**
   * The answer with an [n] link after each cited sentence (n: the source's place in the list), and each
   * source's supporting passage highlighted. `data` is the `citations` event: {citations: [{start, end,
   * source}], highlights: [[start, end]...] per source}. The answer's text itself is left as generated.
   */
  function renderCitations(turn, data) {
    const d = data && typeof data === 'object' ? data : {};
    const cites = (Array.isArray(d.citations) ? d.citations : [])
      .filter((c) => c && isNum(c.end) && isNum(c.source))
      .sort((a, b) => Number(a.end) - Number(b.end));
    const paragraph = turn.querySelector('.answer-text');
    const chars = Array.from(paragraph.textContent);
    const items = turn.querySelectorAll('.source-list .source');
    const fragment = document.createDocumentFragment();
    let last = 0;
    for (const c of cites) {
      const end = Math.min(chars.length, Number(c.end));
      const n = Number(c.source) + 1;
      if (end < last || n < 1 || n > items.length) {
        continue;
      }
      fragment.append(chars.slice(last, end).join(''));
      const link = el('a', {
        class: 'cite', href: `#${sourceAnchor(turn, n)}`, 'data-source': n, text: `[${n}]`,
        'aria-label': `source ${n}`,
      });
      link.addEventListener('click', (ev) => {
        ev.preventDefault();
        showSource(turn, n);
      });
      fragment.append(link);
      last = end;
    }
    fragment.append(chars.slice(last).join(''));
    paragraph.replaceChildren(fragment);
    const highlights = Array.isArray(d.highlights) ? d.highlights : [];
    items.forEach((item, i) => {
      const spans = Array.isArray(highlights[i]) ? highlights[i] : [];
      const passage = item.querySelector('.source-text');
      passage.replaceChildren(highlighted(passage.textContent, spans));
      item.classList.toggle('cited', cites.some((c) => Number(c.source) === i));
    });
  }

  function renderSessionLine() {
    const turns = state.turns;
    $('session-line').textContent =
      `Session ${state.sessionId.slice(0, 8)} · ${turns} ${turns === 1 ? 'question' : 'questions'}` +
      (turns ? ' · follow-up questions keep the context' : '');
  }

  function newConversation() {
    if (state.controller) {
      state.controller.abort();
    }
    state.sessionId = newSessionId();
    state.turns = 0;
    $('turns').replaceChildren();
    $('ask-error').textContent = '';
    renderSessionLine();
  }

  function buildTurn(question) {
    const answerText = document.createTextNode('');
    state.turnSeq += 1;
    const turn = el('li', { class: 'turn', 'data-state': 'streaming', 'data-turn-id': state.turnSeq },
      el('div', { class: 'question-bubble' }, el('span', { class: 'visually-hidden', text: 'Question: ' }), question),
      el('div', { class: 'answer' },
        el('p', { class: 'answer-text', 'aria-busy': 'true' }, answerText),
        el('p', { class: 'answer-status', role: 'status', text: 'Waiting for the first token…' }),
        el('p', { class: 'warning', role: 'alert', hidden: true }),
        el('details', { class: 'stats-box', hidden: true },
          el('summary', { text: 'Engineering stats' }),
          el('dl', { class: 'stats' })),
        el('section', { class: 'sources', hidden: true, 'aria-label': 'Sources' },
          el('h3', { class: 'sources-heading', text: 'Sources' }),
          el('ol', { class: 'source-list' }))));
    return { turn, answerText };
  }

  /** "p. 3" or "pp. 1–3" for a PDF source (page_end: its last page; absent for old indexes). */
  function pageRange(s) {
    if (!isNum(s.page)) {
      return '';
    }
    const first = Number(s.page);
    const last = isNum(s.page_end) ? Number(s.page_end) : first;
    return last > first ? `pp. ${first}–${last}` : `p. ${first}`;
  }

  /** The list of sources; each one's `highlights` (supporting spans, set once the answer is known) marked. */
  function renderSources(turn, sources) {
    const section = turn.querySelector('.sources');
    const list = section.querySelector('.source-list');
    list.replaceChildren();
    if (!Array.isArray(sources) || sources.length === 0) {
      section.hidden = false;
      list.append(el('li', { class: 'empty', text: 'No passage passed the retrieval threshold.' }));
      return;
    }
    sources.forEach((src, i) => {
      const s = src && typeof src === 'object' ? src : {};
      const doc = state.docs.get(String(s.document_id));
      const title = s.title || (doc ? doc.title : String(s.document_id ?? 'document'));
      const bits = [];
      const pages = pageRange(s);
      if (pages) {
        bits.push(pages);
      }
      if (isNum(s.score)) {
        bits.push(`score ${fmt(s.score, 3)}`);
      }
      if (s.attributes && typeof s.attributes === 'object' && !Array.isArray(s.attributes)) {
        for (const [key, value] of Object.entries(s.attributes)) {
          bits.push(`${key}: ${value}`);
        }
      }
      if (isNum(s.start) && isNum(s.end)) {
        bits.push(`chars ${s.start}–${s.end}`);
      }
      const summary = el('summary', {},
        el('span', { class: 'source-index', text: `[${i + 1}]` }), ' ',
        el('span', { class: 'source-title', text: title }),
        bits.length ? el('span', { class: 'source-meta', text: ` · ${bits.join(' · ')}` }) : null);
      const passage = el('blockquote', { class: 'source-text' });
      passage.append(highlighted(String(s.text ?? ''), s.highlights));
      list.append(el('li', {
        class: 'source', id: sourceAnchor(turn, i + 1), 'data-document-id': s.document_id ?? '',
        'data-chunk-id': s.chunk_id ?? '',
      }, el('details', {}, summary, passage)));
    });
    section.hidden = false;
  }

  /** The server's estimate of a queued question's wait, for its status line: nothing until the server has
   *  timed a generation (eta_s null), else whole seconds, at least 1 (an overdue answer ahead reads 0). */
  function waitText(eta) {
    const seconds = eta === null || eta === undefined ? NaN : Number(eta);
    return Number.isFinite(seconds)
      ? ` (about ${Math.max(1, Math.ceil(seconds)).toLocaleString('en-US')} s)` : '';
  }

  /** The status line before the first token: the place in the queue with the estimated wait, or how far
   *  the prompt has been read and how much of it came from the KV cache. */
  function progressText(p) {
    if (p.stage === 'queued') {
      const position = Number(p.position) || 1;
      const wait = waitText(p.eta_s);
      return position === 1 ? `Waiting for the model: next in line${wait}…`
        : `Waiting for the model: ${position.toLocaleString('en-US')} questions ahead${wait}…`;
    }
    const total = Number(p.total) || 0;
    const done = Math.min(Number(p.done) || 0, total);
    const reused = Number(p.reused) || 0;
    if (!total) {
      return 'Reading the documents…';
    }
    const percent = Math.floor((100 * done) / total);
    const cached = reused > 0 ? `, ${reused.toLocaleString('en-US')} from cache` : '';
    return `Reading the documents… ${percent}% (${done.toLocaleString('en-US')} of ` +
      `${total.toLocaleString('en-US')} tokens${cached})`;
  }

  function renderStats(turn, stats) {
    const s = stats && typeof stats === 'object' ? stats : {};
    const dl = turn.querySelector('.stats');
    dl.replaceChildren();
    const rows = [
      ['Tokens/s', fmt(s.tokens_per_second, 1)],
      ['Acceptance length', fmt(s.acceptance_length, 2)],
      ['First token', s.ttft_ms === null || s.ttft_ms === undefined ? '–' : `${fmt(s.ttft_ms, 0)} ms`],
      ['Drafted', s.drafted ?? '–'],
    ];
    if (s.accepted_by_source && typeof s.accepted_by_source === 'object') {
      const parts = Object.entries(s.accepted_by_source).map(([k, v]) => `${k} ${v}`);
      rows.push(['Accepted by source', parts.length ? parts.join(', ') : 'none']);
    }
    if (s.prefix_cache_hit !== undefined && s.prefix_cache_hit !== null) {
      const reused = Number(s.prefix_reused_tokens) || 0;
      rows.push(['Prefix cache', s.prefix_cache_hit ? `hit (${reused.toLocaleString('en-US')} tokens)` : 'miss']);
    }
    if (s.drafted_by_source && typeof s.drafted_by_source === 'object') {
      const parts = Object.entries(s.drafted_by_source).map(([k, v]) => `${k} ${v}`);
      if (parts.length) {
        rows.push(['Drafted by source', parts.join(', ')]);
      }
    }
    if (isNum(s.documents)) {
      const pending = Number(s.documents_pending) || 0;
      rows.push(['Documents', `${Number(s.documents).toLocaleString('en-US')}` +
        (pending ? ` (${pending.toLocaleString('en-US')} still indexing, not read)` : '')]);
    }
    if (s.context === 'documents' || s.context === 'chunks') {
      rows.push(['Context', s.context === 'chunks' ? 'best chunks' : 'whole documents']);
    }
    if (s.mode) {
      rows.push(['Mode', s.mode]);
    }
    if (s.finish_reason) {
      rows.push(['Finish', s.finish_reason === 'length' ? 'max tokens reached' : s.finish_reason]);
    }
    for (const [name, value] of rows) {
      dl.append(el('div', { class: 'stat' }, el('dt', { text: name }), el('dd', { text: value })));
    }
    turn.querySelector('.stats-box').hidden = false; // collapsed: opened by its summary
    const warnings = [];
    if (s.context_truncated) {
      warnings.push(
        'The documents did not fit in the model\'s context: the answer was written from a truncated context.');
    }
    if (Number(s.documents_pending) > 0) {
      const n = Number(s.documents_pending);
      warnings.push(`${plural(n, 'document')} of the collection ${n === 1 ? 'was' : 'were'} still indexing and ` +
        'not read.');
    }
    if (warnings.length) {
      const warning = turn.querySelector('.warning');
      warning.textContent = warnings.join(' ');
      warning.hidden = false;
    }
    if (typeof s.session_id === 'string' && s.session_id) {
      state.sessionId = s.session_id;
    }
  }

  function parseData(data) {
    try {
      return JSON.parse(data);
    } catch (_) {
      return data;
    }
  }

  function setAsking(asking) {
    $('ask-btn').disabled = asking;
    $('stop-btn').disabled = !asking;
    $('ask-form').setAttribute('aria-busy', asking ? 'true' : 'false');
  }

  function finishTurn(turn, stateName, statusText) {
    turn.dataset.state = stateName;
    // Tokens are not announced one by one; screen readers hear once that the answer is complete.
    $('announce').textContent = stateName === 'done' ? 'Answer complete.' : statusText;
    turn.querySelector('.answer-text').setAttribute('aria-busy', 'false');
    const status = turn.querySelector('.answer-status');
    status.textContent = statusText;
    status.hidden = !statusText;
    status.classList.toggle('error', stateName === 'error');
  }

  function readAskSettings() {
    const maxTokens = Math.max(1, Math.floor(Number($('max-tokens').value) || 256));
    const temperature = Math.max(0, Number($('temperature').value) || 0);
    const mode = $('mode').value || 'auto';
    try {
      localStorage.setItem(SETTINGS_STORAGE, JSON.stringify({ maxTokens, temperature, mode }));
    } catch (_) {
      /* ignore */
    }
    return { maxTokens, temperature, mode };
  }

  function restoreAskSettings() {
    try {
      const saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || 'null');
      if (saved && typeof saved === 'object') {
        if (Number.isFinite(saved.maxTokens)) {
          $('max-tokens').value = String(saved.maxTokens);
        }
        if (Number.isFinite(saved.temperature)) {
          $('temperature').value = String(saved.temperature);
        }
        if ([...$('mode').options].some((o) => o.value === saved.mode)) {
          $('mode').value = saved.mode;
        }
      }
    } catch (_) {
      /* ignore */
    }
  }

  async function onAsk(event) {
    event.preventDefault();
    if (state.controller) {
      return;
    }
    const errorLine = $('ask-error');
    errorLine.textContent = '';
    const question = $('question').value.trim();
    if (!question) {
      errorLine.textContent = 'Type a question first.';
      $('question').focus();
      return;
    }
    const collection = state.collection;
    const documentIds = collection ? [] : readyTicked();
    if (!collection && documentIds.length === 0) {
      errorLine.textContent = 'Tick at least one ready document to ask about, or choose a collection.';
      return;
    }
    // one collection, or the ticked documents: never both (the line above the question box says which)
    const scope = collection ? { collection_ids: [collection.id] } : { document_ids: documentIds };
    const { maxTokens, temperature, mode } = readAskSettings();
    const { turn, answerText } = buildTurn(question);
    $('turns').append(turn);
    state.turns += 1;
    renderSessionLine();
    $('question').value = '';
    turn.scrollIntoView({ block: 'nearest' });

    const controller = new AbortController();
    state.controller = controller;
    setAsking(true);
    let gotDone = false;
    let gotError = false;
    let tokens = 0;

    const onEvent = (ev) => {
      const data = parseData(ev.data);
      switch (ev.event) {
        case 'sources':
          renderSources(turn, Array.isArray(data) ? data : (data && data.sources) || []);
          break;
        case 'citations':
          renderCitations(turn, data);
          break;
        case 'token': {
          const text = data && typeof data === 'object' ? data.text : data;
          if (typeof text === 'string' && text) {
            answerText.appendData(text);
            tokens += 1;
            if (tokens === 1) {
              turn.querySelector('.answer-status').textContent = 'Answering…';
            }
          }
          break;
        }
        case 'progress':
          if (tokens === 0 && data && typeof data === 'object') {
            turn.querySelector('.answer-status').textContent = progressText(data);
          }
          break;
        case 'stats':
          renderStats(turn, data);
          break;
        case 'error': {
          gotError = true;
          const err = data && typeof data === 'object' ? data : { message: String(data) };
          finishTurn(turn, 'error', `Error${err.code ? ` (${err.code})` : ''}: ${err.message || 'unknown'}`);
          break;
        }
        case 'done':
          gotDone = true;
          if (data && typeof data === 'object' && typeof data.session_id === 'string' && data.session_id) {
            state.sessionId = data.session_id;
          }
          break;
        default:
          break; // unknown events (and a trailing "[DONE]") are ignored
      }
    };

    try {
      const response = await fetch(url('v1/ask'), {
        method: 'POST',
        headers: authHeaders({ 'Content-Type': 'application/json', Accept: 'text/event-stream' }),
        body: JSON.stringify({
          question,
          ...scope,
          max_tokens: maxTokens,
          temperature,
          stream: true,
          session_id: state.sessionId,
          mode,
        }),
        signal: controller.signal,
      });
      if (!response.ok) {
        throw await errorFromResponse(response);
      }
      const headerSession = response.headers.get('X-Session-Id');
      if (headerSession) {
        state.sessionId = headerSession;
        renderSessionLine();
      }
      const contentType = response.headers.get('Content-Type') || '';
      if (contentType.includes('application/json')) {
        // A server that ignored stream=true: show its whole answer at once.
        const body = await response.json();
        onEvent({ event: 'sources', data: JSON.stringify(body.sources || []) });
        onEvent({ event: 'token', data: JSON.stringify({ text: String(body.answer ?? body.text ?? '') }) });
        if (Array.isArray(body.citations)) {
          const highlights = (body.sources || []).map((s) => (s && s.highlights) || []);
          onEvent({ event: 'citations', data: JSON.stringify({ citations: body.citations, highlights }) });
        }
        if (body.stats) {
          onEvent({ event: 'stats', data: JSON.stringify(body.stats) });
        }
        gotDone = true;
      } else {
        const parser = globalThis.RagspecSSE.createParser(onEvent);
        const reader = response.body.getReader();
        const decoder = new TextDecoder();
        for (;;) {
          const { value, done } = await reader.read();
          if (done) {
            break;
          }
          parser.push(decoder.decode(value, { stream: true }));
        }
        parser.push(decoder.decode());
        parser.end();
      }
      if (!gotError) {
        if (gotDone) {
          finishTurn(turn, 'done', tokens === 0 ? 'The model returned an empty answer.' : '');
        } else {
          finishTurn(turn, 'error', 'The answer stream ended early.');
        }
      }
    } catch (err) {
      if (err && err.name === 'AbortError') {
        finishTurn(turn, 'stopped', 'Stopped.');
      } else {
        finishTurn(turn, 'error', `Error: ${err && err.message ? err.message : String(err)}`);
      }
    } finally {
      if (state.controller === controller) {
        state.controller = null;
      }
      setAsking(false);
      renderSessionLine();
      document.dispatchEvent(new CustomEvent('ragspec:answered', { detail: { sessionId: state.sessionId } }));
    }
  }

  function onStop() {
    if (state.controller) {
      state.controller.abort(); // the server cancels generation when the connection closes
    }
  }

  // ---------------------------------------------------------------------------------------------
  // start

  function init() {
    loadApiKey();
    restoreAskSettings();
    renderSessionLine();
    renderAskTarget();
    $('key-form').addEventListener('submit', saveApiKey);
    $('paste-form').addEventListener('submit', onPasteSubmit);
    $('refresh-docs').addEventListener('click', refreshDocuments);
    $('ask-form').addEventListener('submit', onAsk);
    $('stop-btn').addEventListener('click', onStop);
    $('new-conversation').addEventListener('click', newConversation);
    $('question').addEventListener('keydown', (ev) => {
      if (ev.key === 'Enter' && (ev.ctrlKey || ev.metaKey)) {
        ev.preventDefault();
        $('ask-form').requestSubmit();
      }
    });
    setupDropZone();
    checkHealth();
    setInterval(checkHealth, HEALTH_MS);
    // what history.js (conversations) and capabilities.js (modes, limits) build on
    globalThis.RagspecPage = {
      state, api, el, armDelete, buildTurn, renderSources, renderCitations, finishTurn, renderSessionLine,
      newConversation, refreshDocuments, renderAskTarget, url, authHeaders, errorFromBody, plural, formatBytes,
      clamp01, isNum, wireDropZone, fillDocStatus,
      documentsLoaded: refreshDocuments(),
    };
    document.documentElement.dataset.ready = '1';
  }

  if (document.readyState === 'loading') {
    document.addEventListener('DOMContentLoaded', init);
  } else {
    init();
  }
})();
