"""Hot-expert replicas (``moe.expert_replicas``): the slot table, its planner and token split
(:mod:`.table`), and the replica weights fetched from their owners (:mod:`.fetch`)."""
