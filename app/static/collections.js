/*
 * ragspec web page: collections (/v1/collections). Lists the API key's collections with their documents' counts,
 * creates and deletes them, and picks what a question asks: the ticked documents (document_ids), or one
 * collection (collection_ids), said above the question box. The chosen collection's documents are listed with
 * their indexing progress (polled while any is queued or indexing), uploaded into (several files in one multipart
 * request with collection_id) and taken out of it.
 *
 * Builds on app.js (globalThis.RagspecPage); text from the server only goes in through textContent.
 */
(function () {
  'use strict';

  const POLL_MS = 700;
  const PAGE_SIZE = 100;
  const MAX_PAGES = 50;
  const INDEXING = new Set(['queued', 'indexing']);

  let page = null;
  const cols = {
    list: [], // the collections, oldest first, as GET /v1/collections gives them
    docs: new Map(), // the chosen collection's documents (uploads in flight: local "col-upload-N" ids)
    pollTimer: null,
    uploadSeq: 0,
    labelSeq: 0,
    epoch: 0, // moves on whenever the chosen collection changes: answers about an earlier choice are dropped
    loaded: null,
  };

  function $(id) {
    return document.getElementById(id);
  }

  function chosenId() {
    return page.state.collection ? page.state.collection.id : '';
  }

  function path(...parts) {
    return parts.map((p, i) => (i % 2 ? encodeURIComponent(p) : p)).join('/');
  }

  /** Every item of a cursor-paged list ({data, has_more, last_id}). */
  async function allPages(route) {
    const items = [];
    let after = '';
    for (let i = 0; i < MAX_PAGES; i++) {
      const query = `?limit=${PAGE_SIZE}${after ? `&after=${encodeURIComponent(after)}` : ''}`;
      const body = await page.api('GET', route + query);
      items.push(...(body && Array.isArray(body.data) ? body.data : []));
      if (!body || !body.has_more || !body.last_id) {
        break;
      }
      after = String(body.last_id);
    }
    return items;
  }

  function counts(c) {
    const d = c && c.document_counts && typeof c.document_counts === 'object' ? c.document_counts : {};
    const n = (key) => Number(d[key]) || 0;
    return { ready: n('ready'), total: n('total'), pending: n('queued') + n('indexing'), failed: n('failed') };
  }

  function setStatus(text) {
    const node = $('collection-status');
    node.textContent = text;
    node.hidden = !text;
  }

  function setError(text) {
    $('collection-error').textContent = text;
  }

  // ---------------------------------------------------------------------------------------------
  // the list: a radio group, "the ticked documents" first, then each collection with its ready / total counts

  function itemOf(list, id) {
    for (const li of list.children) {
      if (li.dataset.id === id) {
        return li;
      }
    }
    return null;
  }

  function fillItem(li, c) {
    const k = counts(c);
    const label = li.querySelector('.collection-name');
    label.textContent = String(c.name);
    label.title = String(c.name);
    const text = `${k.ready.toLocaleString()}/${k.total.toLocaleString()} ready`;
    li.querySelector('.collection-counts').textContent = k.pending ? `${text} · ${k.pending} indexing` : text;
    li.dataset.ready = String(k.ready);
    li.dataset.total = String(k.total);
  }

  function renderList() {
    const list = $('collection-list');
    const seen = new Set(['']); // "the ticked documents" stays
    for (const c of cols.list) {
      const id = String(c.id);
      seen.add(id);
      let li = itemOf(list, id);
      if (!li) {
        const n = ++cols.labelSeq;
        const radio = page.el('input', {
          id: `collection-pick-${n}`, class: 'collection-pick', type: 'radio', name: 'ask-target', value: id,
          'aria-describedby': `collection-counts-${n}`,
        });
        li = page.el('li', { class: 'collection', 'data-id': id }, radio,
          page.el('label', { class: 'collection-name', for: `collection-pick-${n}` }),
          page.el('span', { class: 'collection-counts', id: `collection-counts-${n}` }));
        list.append(li);
      }
      fillItem(li, c);
    }
    for (const li of [...list.children]) {
      if (!seen.has(li.dataset.id)) {
        li.remove();
      }
    }
    syncRadios();
    setStatus(cols.list.length ? '' : 'No collections yet: create one to ask many documents at once.');
  }

  function syncRadios() {
    const id = chosenId();
    for (const radio of $('collection-list').querySelectorAll('.collection-pick')) {
      radio.checked = radio.value === id;
    }
  }

  async function refreshList() {
    let fresh;
    try {
      fresh = await allPages('v1/collections');
    } catch (err) {
      setStatus(`Could not list collections: ${err.message}`);
      return;
    }
    cols.list = fresh;
    renderList();
    const id = chosenId();
    if (id) {
      const c = cols.list.find((x) => String(x.id) === id);
      if (c) {
        setChosen(c);
      } else {
        choose(''); // deleted elsewhere
      }
    }
  }

  // ---------------------------------------------------------------------------------------------
  // the choice: what the next question asks

  /** Make `id` ('' : the ticked documents) what questions ask; load and follow its documents. */
  function choose(id) {
    const c = id ? cols.list.find((x) => String(x.id) === id) : null;
    const before = chosenId();
    setChosen(c || null);
    syncRadios();
    if (chosenId() !== before) {
      cols.epoch += 1;
      cols.docs = new Map();
      if (cols.pollTimer !== null) {
        clearTimeout(cols.pollTimer);
        cols.pollTimer = null;
      }
      setError('');
      renderDocs();
      if (c) {
        loadDocs();
      }
    }
  }

  /** The chosen collection (null: none) into the page's state, its panel and the line above the question box. */
  function setChosen(c) {
    const panel = $('collection-panel');
    if (!c) {
      page.state.collection = null;
      panel.hidden = true;
      page.renderAskTarget();
      return;
    }
    const k = counts(c);
    const name = String(c.name);
    page.state.collection = { id: String(c.id), name, ready: k.ready, pending: k.pending, total: k.total };
    const li = itemOf($('collection-list'), String(c.id));
    if (li) {
      fillItem(li, c);
    }
    $('collection-panel-heading').textContent = `Collection “${name}”`;
    const parts = [`${k.ready.toLocaleString()} of ${page.plural(k.total, 'document')} ready`];
    if (k.pending) {
      parts.push(`${k.pending.toLocaleString()} indexing`);
    }
    if (k.failed) {
      parts.push(`${k.failed.toLocaleString()} failed`);
    }
    if (page.isNum(c.chunks) && Number(c.chunks) > 0) {
      parts.push(page.plural(Number(c.chunks), 'chunk'));
    }
    if (page.isNum(c.tokens) && Number(c.tokens) > 0) {
      parts.push(page.plural(Number(c.tokens), 'token'));
    }
    if (page.isNum(c.bytes) && Number(c.bytes) > 0) {
      parts.push(page.formatBytes(Number(c.bytes)));
    }
    $('collection-summary').textContent = parts.join(' · ');
    $('collection-drop-title').textContent = `Add files to “${name}”`;
    $('collection-delete').setAttribute('aria-label', `Delete the collection ${name}`);
    panel.hidden = false;
    page.renderAskTarget();
  }

  // ---------------------------------------------------------------------------------------------
  // the chosen collection's documents

  function normalize(raw) {
    const d = raw && typeof raw === 'object' ? raw : {};
    return {
      id: String(d.id ?? ''),
      title: String(d.title || d.id || 'untitled'),
      status: String(d.status || 'queued'),
      progress: page.clamp01(d.progress),
      message: d.message ? String(d.message) : '',
      chunks: d.chunks ?? null,
      tokens: d.tokens ?? null,
      sizeBytes: d.size_bytes ?? null,
      local: false,
    };
  }

  async function loadDocs() {
    const id = chosenId();
    if (!id) {
      return;
    }
    const epoch = cols.epoch;
    const asked = performance.now();
    let docs;
    let fresh;
    try {
      [docs, fresh] = await Promise.all([
        allPages(path('v1/collections', id, 'documents')), page.api('GET', path('v1/collections', id)),
      ]);
    } catch (err) {
      if (epoch !== cols.epoch) {
        return;
      }
      if (err.status === 404) {
        setError('That collection no longer exists.');
        await refreshList();
        return;
      }
      setError(`Could not list the collection's documents: ${err.message}`);
      schedulePoll(); // documents still indexing: try again
      return;
    }
    if (epoch !== cols.epoch) {
      return; // another collection was chosen meanwhile
    }
    const map = new Map();
    for (const raw of docs) {
      const d = normalize(raw);
      if (d.id) {
        map.set(d.id, d);
      }
    }
    for (const [docId, d] of cols.docs) {
      // uploads in flight or failed here, and uploads accepted after this list was asked for
      if (d.local || (!map.has(docId) && d.uploadedAt > asked)) {
        map.set(docId, d);
      }
    }
    cols.docs = map;
    const at = cols.list.findIndex((x) => String(x.id) === id);
    if (at >= 0) {
      cols.list[at] = fresh;
    }
    setChosen(fresh);
    setError('');
    renderDocs();
    schedulePoll();
  }

  function schedulePoll() {
    if (cols.pollTimer !== null || !chosenId()) {
      return;
    }
    if ([...cols.docs.values()].some((d) => !d.local && INDEXING.has(d.status))) {
      cols.pollTimer = setTimeout(() => {
        cols.pollTimer = null;
        loadDocs();
      }, POLL_MS);
    }
  }

  function renderDocs() {
    const list = $('collection-doc-list');
    const template = $('collection-doc-template');
    const seen = new Set();
    for (const d of cols.docs.values()) {
      seen.add(d.id);
      let li = itemOf(list, d.id);
      if (!li) {
        li = template.content.firstElementChild.cloneNode(true);
        li.dataset.id = d.id;
        const button = li.querySelector('.doc-remove');
        button.addEventListener('click', () => onRemove(li.dataset.id, button));
        list.append(li);
      }
      fillDoc(li, d);
    }
    for (const li of [...list.children]) {
      if (!seen.has(li.dataset.id)) {
        li.remove();
      }
    }
    $('collection-doc-empty').hidden = cols.docs.size > 0;
  }

  function fillDoc(li, d) {
    li.dataset.status = d.status;
    page.fillDocStatus(li, d);

    const details = [];
    if (d.status === 'ready') {
      if (page.isNum(d.chunks)) {
        details.push(page.plural(Number(d.chunks), 'chunk'));
      }
      if (page.isNum(d.tokens)) {
        details.push(page.plural(Number(d.tokens), 'token'));
      }
      if (page.isNum(d.sizeBytes)) {
        details.push(page.formatBytes(Number(d.sizeBytes)));
      }
    }
    const message = li.querySelector('.doc-message');
    const text = d.status === 'failed'
      ? (d.message || 'Indexing failed.')
      : [d.message, details.join(' · ')].filter(Boolean).join(' — ');
    message.textContent = text;
    message.hidden = !text;
    message.classList.toggle('error', d.status === 'failed');
    message.setAttribute('role', d.status === 'failed' ? 'alert' : 'status');

    const button = li.querySelector('.doc-remove');
    button.disabled = d.status === 'uploading';
    button.textContent = d.local ? 'Dismiss' : 'Remove';
    button.setAttribute('aria-label', d.local ? `Dismiss ${d.title}` : `Remove ${d.title} from the collection`);
  }

  /** Take a document out of the chosen collection (it stays in the library); a local failure is dismissed. */
  async function onRemove(docId, button) {
    const d = cols.docs.get(docId);
    const id = chosenId();
    if (!d || !id) {
      return;
    }
    const li = button.closest('li');
    const next = li && (li.nextElementSibling || li.previousElementSibling);
    const moveFocus = () => {
      const target = next && next.isConnected ? next.querySelector('.doc-remove') : null;
      (target || $('collection-file-input')).focus();
    };
    if (d.local) {
      cols.docs.delete(docId);
      renderDocs();
      moveFocus();
      return;
    }
    const epoch = cols.epoch;
    button.disabled = true;
    try {
      await page.api('DELETE', path('v1/collections', id, 'documents', docId));
    } catch (err) {
      if (err.status !== 404) {
        if (epoch === cols.epoch && cols.docs.has(docId)) {
          cols.docs.set(docId, { ...cols.docs.get(docId), message: `Remove failed: ${err.message}` });
          renderDocs();
        }
        button.disabled = false;
        return;
      }
    }
    if (epoch !== cols.epoch) {
      return;
    }
    cols.docs.delete(docId);
    renderDocs();
    moveFocus();
    loadDocs(); // its counts
  }

  /** The files into the chosen collection: one multipart request (XMLHttpRequest: upload progress). */
  function upload(files) {
    const id = chosenId();
    if (!id || !files.length) {
      return;
    }
    const epoch = cols.epoch;
    const current = () => epoch === cols.epoch;
    const locals = files.map((file) => {
      const d = {
        id: `col-upload-${++cols.uploadSeq}`, title: file.name, status: 'uploading', progress: 0,
        message: 'Uploading…', chunks: null, tokens: null, sizeBytes: null, local: true,
      };
      cols.docs.set(d.id, d);
      return d;
    });
    renderDocs();

    const form = new FormData();
    for (const file of files) {
      form.append('file', file, file.name);
    }
    form.append('collection_id', id);
    const xhr = new XMLHttpRequest();
    xhr.open('POST', page.url('v1/documents'));
    xhr.setRequestHeader('Accept', 'application/json');
    if (page.state.apiKey) {
      xhr.setRequestHeader('Authorization', `Bearer ${page.state.apiKey}`);
    }
    xhr.upload.addEventListener('progress', (ev) => {
      if (ev.lengthComputable && current()) {
        for (const d of locals) {
          if (cols.docs.has(d.id)) {
            cols.docs.set(d.id, { ...cols.docs.get(d.id), progress: ev.total ? ev.loaded / ev.total : 0 });
          }
        }
        renderDocs();
      }
    });
    const fail = (message) => {
      if (!current()) {
        return;
      }
      for (const d of locals) {
        cols.docs.set(d.id, { ...d, status: 'failed', progress: 0, message });
      }
      renderDocs();
    };
    xhr.addEventListener('load', () => {
      let body = null;
      try {
        body = xhr.responseText ? JSON.parse(xhr.responseText) : null;
      } catch (_) {
        body = null;
      }
      if (xhr.status < 200 || xhr.status >= 300 || !body) {
        fail(`Upload failed: ${page.errorFromBody(xhr.status, body, xhr.statusText).message}`);
        return;
      }
      page.refreshDocuments(); // the library lists them too
      if (!current()) {
        return;
      }
      const accepted = Array.isArray(body.documents) ? body.documents : [body];
      for (const d of locals) {
        cols.docs.delete(d.id);
      }
      const now = performance.now();
      accepted.forEach((raw, i) => {
        const d = normalize(raw);
        if (!d.id) {
          return;
        }
        if (d.title === d.id && files[i]) {
          d.title = files[i].name;
        }
        d.uploadedAt = now;
        cols.docs.set(d.id, d);
      });
      renderDocs();
      loadDocs(); // the counts, then polled while indexing
    });
    xhr.addEventListener('error', () => fail('Upload failed: network error.'));
    xhr.addEventListener('abort', () => fail('Upload failed: network error.'));
    xhr.send(form);
  }

  // ---------------------------------------------------------------------------------------------
  // create, delete

  async function onCreate(event) {
    event.preventDefault();
    const input = $('collection-name');
    const name = input.value.trim();
    if (!name) {
      input.focus();
      return;
    }
    const button = event.submitter || $('collection-form').querySelector('button');
    button.disabled = true;
    try {
      const c = await page.api('POST', 'v1/collections', { name });
      input.value = '';
      setError('');
      if (!cols.list.some((x) => String(x.id) === String(c.id))) {
        cols.list.push(c);
      }
      renderList();
      choose(String(c.id)); // a collection is made to be used: questions go to it now
    } catch (err) {
      setError(`Could not create the collection: ${err.message}`);
    } finally {
      button.disabled = false;
    }
  }

  // Two steps, as the page deletes anything: the first click arms the button, a second within 4 s deletes.
  function resetDelete(button) {
    button.dataset.armed = '';
    button.textContent = 'Delete collection';
    button.disabled = false;
  }

  async function onDeleteCollection(event) {
    const button = event.currentTarget;
    const id = chosenId();
    if (!id) {
      return;
    }
    if (button.dataset.armed !== '1') {
      button.dataset.armed = '1';
      button.textContent = 'Confirm delete';
      setTimeout(() => {
        if (button.dataset.armed === '1') {
          resetDelete(button);
        }
      }, 4000);
      return;
    }
    button.disabled = true;
    try {
      await page.api('DELETE', path('v1/collections', id));
    } catch (err) {
      if (err.status !== 404) {
        setError(`Could not delete the collection: ${err.message}`);
        resetDelete(button);
        return;
      }
    }
    resetDelete(button);
    cols.list = cols.list.filter((x) => String(x.id) !== id);
    choose('');
    renderList();
    $('target-documents').focus();
  }

  // ---------------------------------------------------------------------------------------------
  // start

  function setupDrop() {
    page.wireDropZone($('collection-drop'), $('collection-file-input'), upload);
  }

  function init() {
    page = globalThis.RagspecPage;
    if (!page) {
      return; // app.js did not start: nothing to build on
    }
    $('collection-list').addEventListener('change', (ev) => {
      const radio = ev.target;
      if (radio && radio.classList.contains('collection-pick') && radio.checked) {
        choose(radio.value);
      }
    });
    $('collection-form').addEventListener('submit', onCreate);
    $('collection-delete').addEventListener('click', onDeleteCollection);
    $('refresh-collections').addEventListener('click', async () => {
      await refreshList();
      loadDocs();
    });
    // ticking a document in the library means asking the ticked documents
    document.addEventListener('ragspec:ticked', () => choose(''));
    // app.js's own listener has already taken the new key (a key is a tenant: other collections)
    $('key-form').addEventListener('submit', () => {
      choose('');
      cols.list = [];
      renderList();
      refreshList();
    });
    setupDrop();
    cols.loaded = refreshList();
    page.collectionsLoaded = cols.loaded;
    /** history.js: a resumed conversation asks what it last asked (a collection id, or '' for the documents). */
    page.chooseCollection = async (id) => {
      await cols.loaded;
      choose(id && cols.list.some((x) => String(x.id) === id) ? id : '');
    };
  }

  if (document.readyState === 'loading') {
    document.addEventListener('DOMContentLoaded', init);
  } else {
    init();
  }
})();
