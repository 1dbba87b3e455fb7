// The signed-in session shared by the chat and operator pages: where the API
// token is kept, how the API is called, and how its errors are put into words.
// The token lives in the browser's session storage (gone when the tab closes) unless
// the user ticks "Remember on this device"; it travels only in headers (or the
// websocket's subprotocol) — never in a URL, where logs and history keep it.
"use strict";

const Session = (() => {
  const KEY = "switchyard.token";

  function token() {
    return sessionStorage.getItem(KEY) || localStorage.getItem(KEY) || "";
  }

  function save(value, remember) {
    forget();
    (remember ? localStorage : sessionStorage).setItem(KEY, value);
  }

  function forget() {
    sessionStorage.removeItem(KEY);
    localStorage.removeItem(KEY);
  }

  /** An error from the API, with its HTTP status and the server's words. */
  class ApiError extends Error {
    constructor(status, body, retryAfter) {
      super((body && body.error) || `HTTP ${status}`);
      this.status = status;
      this.type = (body && body.error_type) || "";
      this.field = (body && body.field) || null;
      this.retryAfter = retryAfter;
    }
  }

  /** Call the API; resolves to the JSON body (null for 204), rejects with ApiError. */
  async function api(method, path, body) {
    const headers = { Accept: "application/json" };
    const t = token();
    if (t) headers.Authorization = `Bearer ${t}`;
    const init = { method, headers };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (err) {
      throw new ApiError(0, { error: "the server could not be reached", error_type: "network" });
    }
    if (response.status === 204) return null;
    let data = null;
    try {
      data = await response.json();
    } catch (err) {
      data = null;
    }
    if (!response.ok) {
      throw new ApiError(response.status, data, response.headers.get("Retry-After"));
    }
    return data;
  }

  /** Plain words for an error a user should read. */
  function describe(err) {
    if (!(err instanceof ApiError)) return `Something went wrong: ${err && err.message ? err.message : err}`;
    const detail = err.message;
    switch (err.status) {
      case 0:
        return "Cannot reach the Switchyard server. Check your connection and try again.";
      case 401:
        return `Your API token was not accepted (401): ${detail}. Sign in again with a valid token.`;
      case 403:
        return `You are not allowed to do that (403): ${detail}.`;
      case 404:
        return `Not found (404): ${detail}.`;
      case 422:
      case 400:
        return `The request was refused (${err.status}): ${detail}.`;
      case 429: {
        const wait = err.retryAfter ? ` Try again in ${err.retryAfter} s.` : " Try again shortly.";
        return `Too many requests (429): ${detail}.${wait}`;
      }
      case 503:
        return `The service is unavailable right now (503): ${detail}.`;
      default:
        return `The server answered ${err.status}: ${detail}.`;
    }
  }

  /** ws:// or wss:// URL of a path on this origin. */
  function wsUrl(path) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    return `${scheme}//${location.host}${path}`;
  }

  return { token, save, forget, api, describe, wsUrl, ApiError };
})();
