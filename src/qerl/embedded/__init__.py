"""The embedded default: a family of reasoning-gym tasks a sub-million-parameter model can learn,
each with a warm-start completion style, and the supervised warm start that leaves RL a skill to
discover.

* :mod:`qerl.embedded.traces` -- ``<think>`` trace builders, one per kind of task;
* :mod:`qerl.embedded.task` -- :class:`~qerl.embedded.task.EmbeddedTask` (generator, config,
  template, trace style) and its prompt rows;
* :mod:`qerl.embedded.presets` -- named presets (``embedded_tasks``): task + model + budget + the
  RL prompts and settings that go with it;
* :mod:`qerl.embedded.sft` -- the supervised loop;
* :mod:`qerl.embedded.warm_start` -- tokenizer + model + SFT until validation accuracy enters the
  accuracy band, with a warning or error when it cannot.
"""
