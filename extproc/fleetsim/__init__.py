"""Fleet simulation: the gateway's own routing, accounting and capacity objects in front of simulated
GPU replicas (the engine model of extproc.sim), in virtual time. `extproc fleet-sim --help`."""
