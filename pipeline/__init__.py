"""Pure, deterministic math of Decoupled DiLoCo: fragmenting, codecs, merge, outer optimizer,
round policy and the one state-transition fold. No I/O, no clocks, no sockets, no unseeded randomness."""
