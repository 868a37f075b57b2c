// Agent admin: each option shows the inputs of its type only (choices for select, a masked
// default for secret, a plain default for text and select). The server enforces the same.
(function () {
  "use strict";
  var SHOWN = {
    text: ["default"],
    select: ["choices", "default"],
    secret: ["secret_value", "clear_secret"],
  };
  var TOGGLED = ["choices", "default", "secret_value", "clear_secret"];

  function update(select) {
    var form = select.closest(".inline-related");
    if (!form) return;
    var shown = SHOWN[select.value] || SHOWN.text;
    TOGGLED.forEach(function (name) {
      form.querySelectorAll(".field-" + name).forEach(function (row) {
        row.style.display = shown.indexOf(name) < 0 ? "none" : "";
      });
    });
  }

  var bound = new WeakSet();  // not an attribute: the "Add another" template is cloned with its attributes

  function bind(root) {
    root.querySelectorAll("select[data-option-type]").forEach(function (select) {
      if (bound.has(select)) return;
      bound.add(select);
      select.addEventListener("change", function () { update(select); });
      update(select);
    });
  }

  document.addEventListener("DOMContentLoaded", function () { bind(document); });
  // Django's admin announces a new inline row ("Add another option").
  document.addEventListener("formset:added", function (event) { bind(event.target); });
})();
