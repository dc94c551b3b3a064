"""Enactment of a plan: parameters and DTensors, gathers, buckets, prefetch, offload, hooks."""
