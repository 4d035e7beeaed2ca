// Live updates for every dashboard page: one WebSocket, reconnect with backoff and jitter, and after a
// reconnect ask the page to re-read its state (the channel layer may have dropped events meanwhile).
(function () {
  "use strict";
  const statusEl = document.getElementById("live-status");
  const activity = document.getElementById("activity");
  let attempt = 0;

  function setStatus(on) {
    if (!statusEl) return;
    statusEl.classList.toggle("on", on);
    statusEl.textContent = on ? "live" : "offline";
  }

  function addActivity(event) {
    if (!activity) return;
    const empty = activity.querySelector(".empty");
    if (empty) empty.remove();
    const li = document.createElement("li");
    li.dataset.kind = event.kind;
    const when = new Date(event.at || Date.now()).toLocaleTimeString();
    li.textContent = when + "  " + event.kind + "  " + JSON.stringify(event.data || {});
    activity.prepend(li);
    while (activity.children.length > 100) activity.lastChild.remove();
  }

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
  window.fleetLive = { addActivity: addActivity };
  connect();
})();
