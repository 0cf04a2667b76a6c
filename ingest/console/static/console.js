// The operator console's only script (CSP: script-src 'self', no inline script).
// Select all shown dead letters; refresh a running replay's progress every second.
(function () {
  "use strict";
  var all = document.getElementById("select-all");
  if (all) {
    all.addEventListener("change", function () {
      var boxes = document.querySelectorAll("input.pick");
      for (var i = 0; i < boxes.length; i++) { boxes[i].checked = all.checked; }
    });
  }
  var progress = document.getElementById("progress");
  if (progress && progress.getAttribute("data-refresh")) {
    window.setTimeout(function () { window.location.reload(); }, 1000);
  }
})();
