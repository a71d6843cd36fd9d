"""Parallel training schemes (DP, ZeRO, TP) built on commlib's collectives."""
