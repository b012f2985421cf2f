"""Head kinds: one spec per kind names everything Headway does with it (config, module, objective,
drafter, tune space, exports), registered once in `registry`; head directories of any registered
kind (`checkpoint`)."""
