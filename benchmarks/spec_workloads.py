"""The speculative-decoding benchmark's prompts: chat requests whose answer copies much of the prompt (repeat,
correct, lightly edit a passage or a piece of code) and plain chat questions whose answer copies nothing.

Fixed texts (no data set download); the i-th request of a workload cycles through instruction x passage
combinations, so up to len(instructions) * len(passages) requests are all distinct prompts."""
from __future__ import annotations

PASSAGES = (
    "The river runs through the old town, past the mill and the church, and under seven stone bridges. In spring "
    "the water rises and the fishermen wait on the banks for the trout to return from the sea. In summer children "
    "swim near the mill, and in autumn the leaves of the chestnut trees float slowly towards the harbour.",
    "Our team meets every Monday at nine to plan the week. Each engineer says what they finished, what they will "
    "do next and what blocks them. The meeting lasts fifteen minutes. Notes are written in the shared document, "
    "and anything that needs a longer discussion is moved to a separate call on Tuesday afternoon.",
    "To reset your password, open the settings page and choose Security. Click on Change password, type your "
    "current password, then type the new password twice. The new password must have at least twelve characters. "
    "After you save it, you will be signed out of every other device and asked to sign in again.",
    "The library opens at eight in the morning and closes at ten in the evening from Monday to Friday. On "
    "weekends it opens at ten and closes at six. Books can be borrowed for three weeks and renewed twice online. "
    "Students need their card to enter the reading rooms on the second and third floors.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    result = []\n    total = 0.0\n    for i, value in enumerate(values):\n        total += value\n"
    "        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n"
    "            result.append(total / window)\n    return result\n",
    "class Inventory:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, name, count):\n"
    "        self.items[name] = self.items.get(name, 0) + count\n\n    def remove(self, name, count):\n"
    "        if self.items.get(name, 0) < count:\n            raise KeyError(name)\n"
    "        self.items[name] -= count\n\n    def total(self):\n        return sum(self.items.values())\n",
)

COPY_INSTRUCTIONS = (
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy the following text and change nothing:\n\n{}",
    "Rewrite the following text exactly as it is, keeping every line:\n\n{}",
    "Here is a text. Return it unchanged.\n\n{}",
    "Fix any spelling mistakes in the following text and return the whole text:\n\n{}",
    "Return the following text again, in full:\n\n{}",
)

CHAT_QUESTIONS = (
    "Write a short poem about the autumn wind.",
    "Explain how a bicycle works to a ten year old.",
    "Give three tips for learning a new language.",
    "What are the benefits of drinking water every day?",
    "Describe a quiet morning in a small village.",
    "How do I make a cup of tea?",
    "Why is the sky blue? Answer in a few sentences.",
    "Suggest a name for a friendly robot and explain why.",
    "What should I pack for a weekend hiking trip?",
    "Write a short story about a cat who finds a key.",
    "How can I stay focused while working from home?",
    "Explain what a computer program is.",
    "Give me a simple recipe for pancakes.",
    "What is the difference between weather and climate?",
    "Describe the sound of rain on a roof.",
    "Why do people keep diaries?",
)

WORKLOADS = ("copy", "chat")


def prompts(workload: str, n: int) -> list[str]:
    """n distinct chat prompts (one user message each) of a workload."""
    if workload == "copy":
        combos = [ins.format(p) for p in PASSAGES for ins in COPY_INSTRUCTIONS]
        # passage-major order interleaved: consecutive requests copy different passages
        combos = [combos[(i % len(PASSAGES)) * len(COPY_INSTRUCTIONS) + (i // len(PASSAGES)) % len(COPY_INSTRUCTIONS)]
                  for i in range(len(combos))]
        pool = combos
    elif workload == "chat":
        pool = [q for q in CHAT_QUESTIONS] + [f"{q} Keep it brief." for q in CHAT_QUESTIONS]
    else:
        raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
    if n > len(pool):
        raise ValueError(f"the {workload} workload has {len(pool)} distinct prompts; asked for {n}")
    return pool[:n]
