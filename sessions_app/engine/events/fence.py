"""The end of a turn's stream: after its `turn_stop` the stream takes no more events."""


class StreamEnded(Exception):
    """A write to a turn's stream after its `turn_stop`: the turn has ended (declared lost
    while its worker was frozen, say) and the writer's events would come after its ending."""

    def __init__(self, turn_id: str):
        super().__init__(f"the stream of turn {turn_id} has ended")
        self.turn_id = turn_id
