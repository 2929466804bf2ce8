/*
 * ragspec /docs: Swagger UI over this server's OpenAPI description, with no CDN (Swagger UI's files come from
 * the fastapi-offline package, served under static/swagger/).
 *
 * /openapi.json needs the API key when keys are on, so this script fetches it itself with the key the browser
 * keeps (the one saved on the main page, or typed in the bar here) and hands the description to Swagger UI;
 * the same key goes on every request "Try it out" sends, unless Swagger UI's own Authorize dialog set one.
 */
(function () {
  'use strict';

  const KEY_STORAGE = 'ragspec.apiKey'; // shared with the main page (same origin)
  let ui = null;

  function $(id) {
    return document.getElementById(id);
  }

  function storedKey() {
    try {
      return localStorage.getItem(KEY_STORAGE) || '';
    } catch (_) {
      return '';
    }
  }

  let apiKey = storedKey();

  function setStatus(text, stateName) {
    const node = $('docs-status');
    node.textContent = text;
    node.dataset.state = stateName || '';
  }

  function withKey(request) {
    const headers = request.headers || {};
    const has = Object.keys(headers).some((h) => h.toLowerCase() === 'authorization');
    if (apiKey && !has) {
      headers.Authorization = `Bearer ${apiKey}`;
    }
    request.headers = headers;
    return request;
  }

  async function load() {
    setStatus('Loading the API description…', 'loading');
    const headers = { Accept: 'application/json' };
    if (apiKey) {
      headers.Authorization = `Bearer ${apiKey}`;
    }
    let response;
    try {
      response = await fetch(new URL('openapi.json', document.baseURI), { headers });
    } catch (err) {
      setStatus(`The server could not be reached: ${err && err.message ? err.message : err}`, 'error');
      return;
    }
    if (response.status === 401) {
      setStatus(apiKey ? 'This API key was refused: enter a valid one above.'
        : 'This server needs an API key: enter it above to see its routes.', 'error');
      $('api-key').focus();
      return;
    }
    if (!response.ok) {
      setStatus(`The API description could not be loaded (HTTP ${response.status}); try again in a moment.`,
        'error');
      return;
    }
    const spec = await response.json();
    setStatus('', '');
    if (typeof globalThis.SwaggerUIBundle !== 'function') {
      setStatus('Swagger UI did not load (static/swagger/swagger-ui-bundle.js).', 'error');
      return;
    }
    ui = globalThis.SwaggerUIBundle({
      spec,
      dom_id: '#swagger-ui',
      deepLinking: true,
      requestInterceptor: withKey,
    });
    document.documentElement.dataset.ready = '1';
  }

  function onKey(event) {
    event.preventDefault();
    apiKey = $('api-key').value.trim();
    try {
      if (apiKey) {
        localStorage.setItem(KEY_STORAGE, apiKey);
      } else {
        localStorage.removeItem(KEY_STORAGE);
      }
    } catch (_) {
      /* storage disabled: the key holds for this page only */
    }
    if (ui === null) {
      load();
    }
  }

  function init() {
    $('api-key').value = apiKey;
    $('key-form').addEventListener('submit', onKey);
    load();
  }

  if (document.readyState === 'loading') {
    document.addEventListener('DOMContentLoaded', init);
  } else {
    init();
  }
})();
