def test_echo_turn_answers_in_every_mode(stack):
    client = stack.client()
    session = client.create_session("echo")
    none = client.turn(session, text="hello there")
    assert none.status == 200
    assert none.messages == [{"role": "assistant", "content": [{"type": "text", "text": "echo: hello there"}]}]
    delta = client.turn(session, text="hello there", stream="delta")
    assert [e.data["delta"] for e in delta.events if e.event == "text_delta"] == ["echo: ", "hello ", "there"]
    message = client.turn(session, text="hello there", stream="message")
    assert message.names == ["turn_start", "text", "turn_stop"]
    assert delta.messages == message.messages == none.messages
