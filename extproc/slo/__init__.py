"""SLO-aware routing's pure parts: profile tables per model, the output-length predictor, the load model
and the gateway queue (docs/slo-routing.md). No I/O, time comes in as `now`: the live gateway and the
fleet simulation run the same objects."""
