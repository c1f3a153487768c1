// Draws every [data-chart] div from the figure in the <script type="application/json">
// element it names (made by Django's json_script), with the local plotly.js. plotly.js
// (~4.8 MB) is fetched only once the page has loaded, so the numbers and tables show
// at once and the charts follow.
(function () {
  "use strict";
  var me = document.currentScript;

  function draw() {
    document.querySelectorAll("[data-chart]").forEach(function (div) {
      var source = document.getElementById(div.dataset.chart);
      if (!source) return;
      var figure = JSON.parse(source.textContent);
      Plotly.newPlot(div, figure.data, figure.layout, {
        responsive: true,
        displaylogo: false,
        modeBarButtonsToRemove: ["sendDataToCloud"],
      });
    });
  }

  function loadPlotly() {
    var script = document.createElement("script");
    script.src = me.dataset.plotly;
    script.onload = draw;
    document.head.appendChild(script);
  }

  if (document.readyState === "complete") loadPlotly();
  else window.addEventListener("load", loadPlotly);
})();
