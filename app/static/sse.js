/*
 * A small incremental parser for text/event-stream (the server-sent events wire format).
 *
 * EventSource cannot send a POST body, so the page reads `fetch()`'s ReadableStream and feeds the
 * decoded text here, chunk by chunk. Chunks may split a line, a "\r\n" pair or an event anywhere.
 *
 *   const parser = RagspecSSE.createParser((ev) => console.log(ev.event, ev.data));
 *   parser.push(textChunk);   // as many times as needed
 *   parser.end();             // at end of stream
 *
 * Each dispatched event is {event, data, id}: `event` defaults to "message", `data` joins the event's
 * data lines with "\n" (as the specification says), `id` is the last id seen ("" when none).
 */
(function (root) {
  'use strict';

  function createParser(onEvent) {
    let buffer = '';
    let eventName = '';
    let dataLines = [];
    let lastId = '';

    function dispatch() {
      if (dataLines.length === 0) {
        eventName = '';
        return;
      }
      const ev = { event: eventName || 'message', data: dataLines.join('\n'), id: lastId };
      eventName = '';
      dataLines = [];
      onEvent(ev);
    }

    function processLine(line) {
      if (line === '') {
        dispatch();
        return;
      }
      if (line.charCodeAt(0) === 58 /* ':' comment / keep-alive */) {
        return;
      }
      const colon = line.indexOf(':');
      let field = line;
      let value = '';
      if (colon !== -1) {
        field = line.slice(0, colon);
        value = line.slice(colon + 1);
        if (value.charCodeAt(0) === 32 /* one leading space is not part of the value */) {
          value = value.slice(1);
        }
      }
      if (field === 'event') {
        eventName = value;
      } else if (field === 'data') {
        dataLines.push(value);
      } else if (field === 'id') {
        if (value.indexOf('\u0000') === -1) {
          lastId = value;
        }
      }
      // "retry" and unknown fields are ignored: the page never reconnects by itself.
    }

    function drain(final) {
      let start = 0;
      for (let i = 0; i < buffer.length; i++) {
        const c = buffer.charCodeAt(i);
        if (c === 10 /* \n */) {
          processLine(buffer.slice(start, i));
          start = i + 1;
        } else if (c === 13 /* \r */) {
          if (i + 1 === buffer.length && !final) {
            break; // a "\n" may follow in the next chunk
          }
          processLine(buffer.slice(start, i));
          if (buffer.charCodeAt(i + 1) === 10) {
            i += 1;
          }
          start = i + 1;
        }
      }
      buffer = buffer.slice(start);
    }

    return {
      push(text) {
        if (!text) {
          return;
        }
        buffer += text;
        drain(false);
      },
      end() {
        drain(true);
        if (buffer !== '') {
          processLine(buffer);
          buffer = '';
        }
        // Be lenient with a stream that stops right after its last data line.
        dispatch();
      },
    };
  }

  root.RagspecSSE = { createParser };
})(typeof globalThis !== 'undefined' ? globalThis : this);
