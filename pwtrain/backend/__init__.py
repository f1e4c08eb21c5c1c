"""The Pathways-style single-controller runtime: islands, compiled pieces, async dispatch."""

from pwtrain.backend.cluster import Cluster, Island
from pwtrain.backend.controller import Controller
from pwtrain.backend.dispatch import LocalDispatcher
from pwtrain.backend.program import Executable, Node, Program, Transfer
from pwtrain.backend.resources import ResourceManager
from pwtrain.backend.trace import Trace

__all__ = [
  "Cluster",
  "Controller",
  "Executable",
  "Island",
  "LocalDispatcher",
  "Node",
  "Program",
  "ResourceManager",
  "Trace",
  "Transfer",
]
