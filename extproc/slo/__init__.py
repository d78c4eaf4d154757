"""SLO-aware routing (docs/slo-routing.md): the slo* strategies and the settings they own, their pure parts
(profile tables per model, the output-length predictor, the load model, the queue and the waiting room
over it: time comes in as `now`, so the live gateway and the fleet simulation run the same objects),
and the live gateway's asyncio shell around the room and background refresh. Builds on extproc.routing;
extproc.strategies registers it."""
