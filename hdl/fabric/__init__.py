"""The fabric: tiles on two meshes, the configuration loader and the host port."""
