"""Which form a chat template takes a message's content in (vLLM's ``chat_template_content_format``): "string",
the text itself, or "openai", a list of ``{"type": "text", "text": ...}`` parts (and image parts) that the template
walks. A template of the second kind renders nothing of a string content it loops over part by part, so "auto"
reads the template: it takes parts where it loops over the content of a message taken from ``messages`` (vLLM's
``_detect_content_format`` decides the same way, on the template's jinja syntax tree).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")


@lru_cache(maxsize=64)
def detect_content_format(template: str) -> ContentFormat:
    """ "openai" when ``template`` has a ``for`` loop over ``m.content`` or ``m['content']`` of a variable ``m`` that
    a loop over (or an assignment from) ``messages`` binds, else "string" (a template that does not parse too:
    rendering it reports its error)."""
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError:
        return "string"

    # Names bound to the conversation or a part of it: ``messages``, and what an assignment from them binds
    # (``{% set loop_messages = messages[1:] %}``, ``{% set first = messages[0] %}``), to a fixed point.
    conversation = {"messages"}

    def reads_conversation(node: nodes.Node) -> bool:  # find_all walks the node's children, not the node
        names = [node, *node.find_all(nodes.Name)]
        return any(isinstance(name, nodes.Name) and name.name in conversation for name in names)

    assigns = [(a.target.name, a.node) for a in tree.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)]
    while True:
        bound = {name for name, value in assigns if reads_conversation(value)} - conversation
        if not bound:
            break
        conversation |= bound
    # A message: a loop's variable over the conversation, or a name an assignment bound to a part of it.
    message_names = set(conversation) - {"messages"}
    for loop in tree.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and reads_conversation(loop.iter):
            message_names.add(loop.target.name)

    def is_content(node: nodes.Node) -> bool:
        while isinstance(node, nodes.Filter | nodes.Test):  # message.content | selectattr(...)
            if node.node is None:
                return False
            node = node.node
        if isinstance(node, nodes.Getattr):
            return node.attr == "content" and isinstance(node.node, nodes.Name) and node.node.name in message_names
        if isinstance(node, nodes.Getitem):
            key = node.arg
            return (
                isinstance(key, nodes.Const)
                and key.value == "content"
                and isinstance(node.node, nodes.Name)
                and node.node.name in message_names
            )
        return False

    return "openai" if any(is_content(loop.iter) for loop in tree.find_all(nodes.For)) else "string"
