"""What gateways, and the workers of `serve --workers N`, share: in-flight counts, token totals and the
speed sums, through Redis (one instance, a Cluster or Sentinel) or shared memory. The learners that use
it are in `extproc/state/`."""
