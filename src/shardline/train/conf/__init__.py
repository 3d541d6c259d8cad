"""Hydra configs shipped with shardline (a package so Hydra can find them by module)."""
