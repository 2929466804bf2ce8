/*
 * ragspec web page: past conversations (GET/DELETE /v1/sessions). The current conversation's id is kept in
 * this browser, so a reload shows it again (its turns as the server kept them) and a follow-up continues it;
 * the list resumes or deletes any other of this API key's conversations. A resumed conversation asks again what it
 * last asked: its documents ticked, or its collection chosen (collections.js).
 *
 * Builds on app.js (globalThis.RagspecPage); text from the server only goes in through textContent.
 */
(function () {
  'use strict';

  const CURRENT_STORAGE = 'ragspec.sessionId';
  let page = null;
  let loaded = null; // the first listing (and resume), for the page's loading state

  function $(id) {
    return document.getElementById(id);
  }

  function remember(sessionId) {
    try {
      if (sessionId) {
        localStorage.setItem(CURRENT_STORAGE, sessionId);
      } else {
        localStorage.removeItem(CURRENT_STORAGE);
      }
    } catch (_) {
      /* storage disabled: no resume after a reload */
    }
  }

  function remembered() {
    try {
      return localStorage.getItem(CURRENT_STORAGE) || '';
    } catch (_) {
      return '';
    }
  }

  function when(seconds) {
    const date = new Date(Number(seconds) * 1000);
    return Number.isFinite(date.getTime()) ? date.toLocaleString() : '';
  }

  function setHistoryStatus(text, isError) {
    const node = $('history-status');
    node.textContent = text;
    node.classList.toggle('error', Boolean(isError));
    node.hidden = !text;
  }

  async function refreshList() {
    const { el, api } = page;
    let body;
    try {
      body = await api('GET', 'v1/sessions');
    } catch (err) {
      setHistoryStatus(`Could not list conversations: ${err.message}`, true);
      return;
    }
    const sessions = body && Array.isArray(body.sessions) ? body.sessions : [];
    const list = $('history-list');
    list.replaceChildren();
    for (const s of sessions) {
      const id = String(s.id);
      const current = id === page.state.sessionId;
      const open = el('button', {
        class: 'history-open link', type: 'button', 'aria-current': current ? 'true' : null,
        title: `Resume: ${s.title}`,
      }, el('span', { class: 'history-title', text: s.title || id }),
      el('span', { class: 'history-meta', text: `${s.turns} ${s.turns === 1 ? 'question' : 'questions'} · ${when(s.updated)}` }));
      open.addEventListener('click', () => resume(id, true));
      const del = el('button', {
        class: 'history-delete secondary small', type: 'button', text: 'Delete',
        'aria-label': `Delete the conversation ${s.title}`,
      });
      del.addEventListener('click', () => onDelete(del, id));
      list.append(el('li', { class: 'history-item', 'data-id': id }, open, del));
    }
    $('history-count').textContent = String(sessions.length);
    setHistoryStatus(sessions.length ? '' : 'No past conversations yet.', false);
  }

  /** Show a kept conversation and make it the current one (follow-ups continue it). */
  async function resume(sessionId, fromList) {
    const { api, state, buildTurn, renderSources, finishTurn, renderSessionLine } = page;
    const before = { sessionId: state.sessionId, turnSeq: state.turnSeq };
    let body;
    try {
      body = await api('GET', `v1/sessions/${encodeURIComponent(sessionId)}`);
    } catch (err) {
      if (err.status === 404) {
        if (remembered() === sessionId) {
          remember('');
        }
        if (fromList) {
          setHistoryStatus('That conversation has expired or was deleted.', true);
          refreshList();
        }
      } else {
        setHistoryStatus(`Could not open the conversation: ${err.message}`, true);
      }
      return false;
    }
    if (!fromList && (state.sessionId !== before.sessionId || state.turnSeq !== before.turnSeq)) {
      // the page's own resume after a reload, answered after the user started a new conversation or asked: theirs
      return false;
    }
    if (state.controller) {
      state.controller.abort();
    }
    const turns = $('turns');
    turns.replaceChildren();
    const kept = Array.isArray(body.turns) ? body.turns : [];
    for (const t of kept) {
      const question = String(t.question ?? '');
      const { turn, answerText } = buildTurn(question);
      answerText.appendData(String(t.answer ?? ''));
      turns.append(turn);
      if (Array.isArray(t.sources) && t.sources.length) {
        renderSources(turn, t.sources); // each source's highlights were kept with it
        if (t.citations && typeof t.citations === 'object') {
          page.renderCitations(turn, t.citations); // the answer's [n] links, as when it was streamed
        }
      }
      turn.dataset.kept = '1';
      finishTurn(turn, 'done', '');
    }
    state.sessionId = String(body.id);
    state.turns = Number(body.asked) || kept.length;
    // what the conversation last asked about, as a follow-up would (the server's rule): a turn that named neither
    // documents nor collections asked the ones before it
    const asked = [...kept].reverse().find((t) => (Array.isArray(t.documents) && t.documents.length) ||
      (Array.isArray(t.collection_ids) && t.collection_ids.length));
    await tickDocuments(asked ? asked.documents : []);
    if (asked && page.chooseCollection) {
      const ids = Array.isArray(asked.collection_ids) ? asked.collection_ids : [];
      await page.chooseCollection(ids.length ? String(ids[0]) : ''); // the page asks one collection at a time
    }
    remember(state.sessionId);
    renderSessionLine();
    $('ask-error').textContent = '';
    for (const item of $('history-list').children) {
      item.querySelector('.history-open').setAttribute('aria-current', item.dataset.id === state.sessionId ? 'true' : 'false');
    }
    return true;
  }

  /** Tick the documents the conversation last asked about (those still listed and ready), as if by hand. */
  async function tickDocuments(ids) {
    await page.documentsLoaded;
    for (const id of Array.isArray(ids) ? ids : []) {
      for (const li of $('doc-list').children) {
        const check = li.querySelector('.doc-check');
        if (li.dataset.id === String(id) && check && !check.disabled && !check.checked) {
          check.checked = true;
          check.dispatchEvent(new Event('change'));
        }
      }
    }
  }

  async function onDelete(button, sessionId) {
    if (page.armDelete(button)) return;
    button.disabled = true;
    try {
      await page.api('DELETE', `v1/sessions/${encodeURIComponent(sessionId)}`);
    } catch (err) {
      if (err.status !== 404) {
        setHistoryStatus(`Could not delete the conversation: ${err.message}`, true);
        button.disabled = false;
        button.dataset.armed = '';
        button.textContent = 'Delete';
        return;
      }
    }
    if (sessionId === page.state.sessionId) {
      remember('');
      page.newConversation();
    }
    await refreshList();
  }

  async function start() {
    const current = remembered();
    if (current) {
      await resume(current, false);
    }
    await refreshList();
  }

  function init() {
    page = globalThis.RagspecPage;
    if (!page) {
      return; // app.js did not start: nothing to build on
    }
    document.addEventListener('ragspec:answered', (ev) => {
      if (page.state.turns > 0) {
        remember(ev.detail && ev.detail.sessionId);
      }
      refreshList();
    });
    $('new-conversation').addEventListener('click', () => {
      remember('');
      refreshList();
    });
    // app.js's own listener has already taken the new key (a key is a tenant: other conversations)
    $('key-form').addEventListener('submit', () => {
      remember('');
      refreshList();
    });
    loaded = start();
    page.historyLoaded = loaded;
  }

  if (document.readyState === 'loading') {
    document.addEventListener('DOMContentLoaded', init);
  } else {
    init();
  }
})();
