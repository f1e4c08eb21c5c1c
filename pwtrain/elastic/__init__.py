"""Elastic pods (`fault.elastic=True`): a lost pod costs seconds, not a restart.

steps      `ElasticSteps`: the run's steps over the live pods (drop, run again, rejoin)
podsets    each set of live pods' harness (lost pods hosted, or rebuilt) and the state moved
           between them
cells      the live pods' cells kept, copied or rebuilt for another pod set
lines      a drop's or a rejoin's log line
agreement  distributed mode: the processes' agreement, step by step, on the live pods
wedge      the drill `wedge:`: a pod's islands sent a computation that never ends
"""

from pwtrain.elastic.steps import ElasticSteps

__all__ = ["ElasticSteps"]
