"""Elastic pods (`fault.elastic=True`): a lost pod costs seconds, not a restart.

steps      `ElasticSteps`: the run's steps over the live pods (drop, run again, rejoin)
cells      the live pods' state moved onto another pod set
agreement  distributed mode: the processes' agreement, step by step, on the live pods
"""

from pwtrain.elastic.steps import ElasticSteps

__all__ = ["ElasticSteps"]
