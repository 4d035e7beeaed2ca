// Live updates for every dashboard page: one WebSocket, reconnect with backoff and jitter.
//
// The page says which events concern it (<body data-live-kinds="device.,delta.">: kind prefixes) and marks
// the parts that show server state with data-live-region (each with an id). When such an event arrives, or
// after a reconnect (the channel layer may have dropped events meanwhile), the page re-reads itself from the
// server and swaps those regions in place: the server stays the one source of truth, nothing reloads.
// Pages whose changes have no live event yet poll instead (<body data-live-poll="seconds">).
(function () {
  "use strict";
  const statusEl = document.getElementById("live-status");
  const activity = document.getElementById("activity");
  const kinds = (document.body.dataset.liveKinds || "")
    .split(",").map(function (k) { return k.trim(); }).filter(Boolean);
  const pollSeconds = parseInt(document.body.dataset.livePoll || "0", 10);
  const MIN_INTERVAL_MS = 1000; // at most one re-read a second, however many events arrive
  let attempt = 0;
  let refreshTimer = null;
  let refreshing = false;
  let dirty = false;
  let lastRefresh = 0;

  function setStatus(on) {
    if (!statusEl) return;
    statusEl.classList.toggle("on", on);
    statusEl.textContent = on ? "live" : "offline";
  }

  // "14:03:07 UTC": the dashboard shows every time in UTC, whatever the browser's zone.
  function utcTime(iso) {
    const when = new Date(iso || Date.now());
    return (isNaN(when) ? new Date() : when).toISOString().slice(11, 19) + " UTC";
  }

  // One line of the live feed: when, then what happened in words (the server writes event.text), linked to
  // the page it is about when there is one.
  function addActivity(event) {
    if (!activity) return;
    const empty = activity.querySelector(".empty");
    if (empty) empty.remove();
    const li = document.createElement("li");
    li.dataset.kind = event.kind;
    const time = document.createElement("time");
    time.dateTime = event.at || "";
    time.textContent = utcTime(event.at);
    const text = event.text || event.kind.replace(/[._]/g, " ");
    const what = document.createElement(event.url ? "a" : "span");
    if (event.url) what.href = event.url;
    what.textContent = text;
    li.append(time, " ", what);
    activity.prepend(li);
    while (activity.children.length > 100) activity.lastChild.remove();
  }

  function concerns(kind) {
    return kinds.some(function (prefix) { return kind === prefix || kind.indexOf(prefix) === 0; });
  }

  function regions(root) {
    return Array.prototype.slice.call(root.querySelectorAll("[data-live-region][id]"));
  }

  function busy(region) {
    // Never pull the rug from under someone typing or choosing in a region: try again after they leave it.
    const active = document.activeElement;
    return active && region.contains(active) && /^(INPUT|TEXTAREA|SELECT)$/.test(active.tagName) &&
      active.type !== "checkbox" && active.type !== "submit";
  }

  function swap(current, fresh) {
    const checked = new Set();
    current.querySelectorAll("input[type=checkbox]:checked").forEach(function (box) {
      checked.add(box.name + "=" + box.value);
    });
    // A table scrolled sideways (a phone) stays where the user scrolled it.
    const scrolled = Array.prototype.map.call(current.querySelectorAll("table"), function (t) { return t.scrollLeft; });
    current.innerHTML = fresh.innerHTML;
    current.querySelectorAll("input[type=checkbox]").forEach(function (box) {
      if (checked.has(box.name + "=" + box.value)) box.checked = true;
    });
    current.querySelectorAll("table").forEach(function (table, index) {
      if (scrolled[index]) table.scrollLeft = scrolled[index];
    });
  }

  function asServed(region) {
    // The region's HTML as the server sent it: without what app.js adds on a phone (the sideways-scroll cue
    // under a wide table, its "scrolls" mark), so a re-read with nothing new leaves it alone (and where the
    // user scrolled the table to).
    if (!region.querySelector(".scroll-cue, table.scrolls")) return region.innerHTML;
    const copy = region.cloneNode(true);
    copy.querySelectorAll(".scroll-cue").forEach(function (cue) { cue.remove(); });
    copy.querySelectorAll("table.scrolls").forEach(function (table) { table.classList.remove("scrolls"); });
    return copy.innerHTML;
  }

  function refresh() {
    refreshTimer = null;
    if (!regions(document).length) return;
    if (refreshing) { dirty = true; return; }
    if (document.hidden) { dirty = true; return; }
    refreshing = true;
    dirty = false;
    lastRefresh = Date.now();
    fetch(location.href, { headers: { "X-Live-Refresh": "1" }, credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.text();
      })
      .then(function (html) {
        const doc = new DOMParser().parseFromString(html, "text/html");
        let deferred = false;
        regions(document).forEach(function (region) {
          const fresh = doc.getElementById(region.id);
          if (!fresh) return;
          if (busy(region)) { deferred = true; return; }
          if (fresh.innerHTML !== asServed(region)) swap(region, fresh);
        });
        if (deferred) dirty = true;
        document.body.dataset.liveRefreshed = String(Date.now());
        document.dispatchEvent(new CustomEvent("fleet:refreshed"));
      })
      .catch(function () { dirty = true; }) // a failed re-read is retried with the next event or poll
      .finally(function () {
        refreshing = false;
        if (dirty) schedule();
      });
  }

  function schedule() {
    if (refreshTimer) return;
    const wait = Math.max(150, MIN_INTERVAL_MS - (Date.now() - lastRefresh));
    refreshTimer = setTimeout(refresh, wait);
  }

  document.addEventListener("fleet:resync", schedule);
  document.addEventListener("visibilitychange", function () { if (!document.hidden && dirty) schedule(); });
  document.addEventListener("focusout", function () { if (dirty) schedule(); });
  if (pollSeconds > 0) setInterval(schedule, pollSeconds * 1000);

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(scheme + "://" + location.host + "/ws/live/");
    socket.onopen = function () {
      setStatus(true);
      if (attempt > 0) document.dispatchEvent(new CustomEvent("fleet:resync"));
      attempt = 0;
    };
    socket.onmessage = function (message) {
      const event = JSON.parse(message.data);
      if (event.kind === "hello" || event.kind === "pong") return;
      addActivity(event);
      if (concerns(event.kind)) schedule();
      document.dispatchEvent(new CustomEvent("fleet:event", { detail: event }));
    };
    socket.onclose = function (close) {
      setStatus(false);
      if (close.code === 4401) return; // signed out: reconnecting cannot help
      attempt += 1;
      const delay = Math.min(30000, 500 * 2 ** Math.min(attempt, 6)) * (0.5 + Math.random() / 2);
      setTimeout(connect, delay);
    };
  }
  window.fleetLive = { addActivity: addActivity, refresh: schedule };
  connect();
})();
