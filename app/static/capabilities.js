/*
 * ragspec web page: offer what this server answers (GET /v1/capabilities). Decoding modes the server cannot
 * serve here are hidden (asking for one would be refused as "not available"), and the max-tokens input is
 * bounded by the server's max_new_tokens. Also ends the page's loading state once its data is in.
 *
 * Builds on app.js (globalThis.RagspecPage), collections.js and history.js.
 */
(function () {
  'use strict';

  function $(id) {
    return document.getElementById(id);
  }

  async function load(page) {
    let caps;
    try {
      caps = await page.api('GET', 'v1/capabilities');
    } catch (_) {
      return; // e.g. a key is needed and not entered yet: keep the page's defaults, retried on a new key
    }
    const select = $('mode');
    const modes = new Map((Array.isArray(caps.modes) ? caps.modes : []).map((m) => [String(m.name), m]));
    for (const option of select.options) {
      const mode = modes.get(option.value);
      const off = mode !== undefined && !mode.available;
      option.hidden = off;
      option.disabled = off;
      option.title = off ? String(mode.reason || 'not available on this server') : '';
    }
    if (select.selectedOptions.length === 0 || select.selectedOptions[0].disabled) {
      select.value = 'auto';
    }
    const max = Number(caps.max_new_tokens);
    const input = $('max-tokens');
    if (Number.isInteger(max) && max > 0) {
      input.max = String(max);
      if (Number(input.value) > max) {
        input.value = String(max);
      }
      $('max-tokens-hint').textContent = `at most ${max.toLocaleString('en-US')}`;
    }
  }

  async function init() {
    const page = globalThis.RagspecPage;
    if (!page) {
      return;
    }
    $('key-form').addEventListener('submit', () => load(page));
    await Promise.allSettled([load(page), page.documentsLoaded, page.collectionsLoaded, page.historyLoaded]);
    const root = document.documentElement;
    delete root.dataset.loading;
    $('page-loading').hidden = true;
    root.dataset.loaded = '1';
  }

  if (document.readyState === 'loading') {
    document.addEventListener('DOMContentLoaded', init);
  } else {
    init();
  }
})();
