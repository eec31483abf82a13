// The rendered chart's objects that are CRDs (ServiceMonitor, PrometheusRule, HTTPRoute), checked
// against their schemas: the validators @kubernetes-models generates from prometheus-operator's and
// the Gateway API's CRDs (npm). Reads a JSON array of objects on stdin, prints one line per object,
// exits 1 if any is invalid.
import { ServiceMonitor, PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";
import { HTTPRoute } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1";
const models = { ServiceMonitor, PrometheusRule, HTTPRoute };
const docs = JSON.parse(await new Promise((ok) => { let s = ""; process.stdin.on("data", (d) => (s += d)); process.stdin.on("end", () => ok(s)); }));
let bad = 0;
for (const d of docs) {
  const M = models[d.kind];
  if (!M) { console.log(`skip ${d.kind}`); continue; }
  try { new M(d).validate(); console.log(`ok ${d.kind}/${d.metadata.name}`); }
  catch (e) { bad++; console.log(`invalid ${d.kind}/${d.metadata.name}: ${e.message}`); }
}
process.exit(bad ? 1 : 0);
