"""The NIXL transport between P and D: agents (`agent`), P's side (`prefill`), D's side (`decode`)."""
