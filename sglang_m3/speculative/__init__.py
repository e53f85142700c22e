"""EAGLE3 speculative decoding for M3: the target's aux hidden-state layers, start-up checks of a
draft against its target, and the tiny draft that tests serve with the tiny M3."""
