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
})();
