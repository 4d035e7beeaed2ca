// Small page behaviours: confirm before consequential actions, select all rows for bulk actions.
(function () {
  "use strict";

  // <form data-confirm="..."> asks before it submits; so does a submit button with data-confirm-bulk.
  document.addEventListener("submit", function (event) {
    const form = event.target;
    const button = event.submitter;
    const question = (button && button.dataset.confirmBulk) || form.dataset.confirm;
    if (button && button.dataset.confirmBulk) {
      const count = form.querySelectorAll('input[type=checkbox][name="device"]:checked').length;
      if (count === 0) {
        event.preventDefault();
        alert("Select at least one device first.");
        return;
      }
      if (!confirm(question + " (" + count + " selected)")) event.preventDefault();
      return;
    }
    if (question && !confirm(question)) event.preventDefault();
  });

  // <input type=checkbox data-select-all="device"> toggles every checkbox named "device" in its form.
  document.addEventListener("change", function (event) {
    const box = event.target;
    if (!box.dataset || !box.dataset.selectAll) return;
    const form = box.closest("form") || document;
    form.querySelectorAll('input[type=checkbox][name="' + box.dataset.selectAll + '"]').forEach(function (other) {
      other.checked = box.checked;
    });
  });

  // <form data-settings-by-method='{"method": [setting, ...]}'> (the adapter's personalization form): the fields
  // of the settings the chosen method does not use are greyed out and say so; they stay editable and are saved.
  function markUnused(form) {
    const uses = JSON.parse(form.dataset.settingsByMethod)[form.elements.method.value] || [];
    form.querySelectorAll(".field[data-setting]").forEach(function (field) {
      const name = field.dataset.setting;
      const unused = name !== "method" && uses.indexOf(name) < 0;
      let note = field.querySelector(".unused-note");
      field.classList.toggle("unused", unused);
      if (!unused) { if (note) note.remove(); return; }
      if (!note) {
        note = document.createElement("small");
        note.className = "unused-note";
        field.appendChild(note);
      }
      note.textContent = "Not used by " + form.elements.method.value + ".";
    });
  }
  document.addEventListener("change", function (event) {
    const form = event.target.form;
    if (form && form.dataset.settingsByMethod && event.target.name === "method") markUnused(form);
  });
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("form[data-settings-by-method]").forEach(markUnused);
  });

  // On a phone a list table wider than its card scrolls sideways inside itself (app.css); say so under it, so
  // the columns past the edge are not a secret. Checked on load, on resize and after a live re-read.
  function cueScrolling() {
    document.querySelectorAll("table.list").forEach(function (table) {
      const overflowing = table.scrollWidth > table.clientWidth + 1;
      let cue = table.nextElementSibling;
      const has = cue && cue.classList.contains("scroll-cue");
      table.classList.toggle("scrolls", overflowing);
      if (overflowing && !has) {
        cue = document.createElement("p");
        cue.className = "scroll-cue";
        cue.setAttribute("aria-hidden", "true");
        cue.textContent = "More columns: scroll the table sideways →";
        table.after(cue);
      } else if (!overflowing && has) {
        cue.remove();
      }
    });
  }
  document.addEventListener("DOMContentLoaded", cueScrolling);
  document.addEventListener("fleet:refreshed", cueScrolling);
  window.addEventListener("resize", cueScrolling);
})();
