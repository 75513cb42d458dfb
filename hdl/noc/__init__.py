"""The network-on-chip: routers, meshes and the random link stalls of race tests."""
