"""Parallelism: logical-axis sharding, the plan of islands and meshes."""
