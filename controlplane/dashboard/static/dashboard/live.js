// Keeps each [data-live-url] region current: every data-live-interval ms (default
// 3000) it fetches the region's fragment and swaps it in when it changed. It stops
// when the session has ended (a redirect to the login page) or the server refuses.
(function () {
  "use strict";
  document.querySelectorAll("[data-live-url]").forEach(function (region) {
    var every = Number(region.dataset.liveInterval || 3000);
    var last = null;
    var timer = setInterval(refresh, every);

    function refresh() {
      if (document.hidden) return;
      fetch(region.dataset.liveUrl, { credentials: "same-origin" })
        .then(function (response) {
          if (response.redirected || !response.ok) {
            clearInterval(timer);
            region.dataset.liveStopped = String(response.status);
            return null;
          }
          return response.text();
        })
        .then(function (html) {
          if (html === null || html === last) return;
          last = html;
          region.innerHTML = html;
          region.dataset.liveUpdated = new Date().toISOString();
        })
        .catch(function () { /* a network blip: the next tick tries again */ });
    }
  });
})();
