"""The one log line of each drop and rejoin of elastic pods (steps.py)."""


def line(kind, pods, cause, at, live, seconds, detect_s, again, parts, hosts) -> str:
  """`kind` "drop" or "rejoin" of `pods` for `cause`, `at` (where: "at step N", "during the
  evaluation after step N"); `live`: (live pods, pods); `detect_s`: a drill's seconds from the
  kill to the drop (None: not known); `parts`: the seconds by cause; `again`: what runs again;
  `hosts`: {lost pod: the pods its work runs on} (podsets.py: hosted, nothing compiled)."""
  text = f"pod {','.join(map(str, pods))} {'lost' if kind == 'drop' else 'rejoined'} ({cause}) "
  text += f"{at}: {live[0]} of {live[1]} pods live; "
  if detect_s is not None:
    text += f"found {detect_s:.2f} s after the fault; "
  detail = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in parts.items())
  text += f"took {seconds:.2f} s ({detail})"
  if again:
    text += f"; {again}"
  for pod, on in hosts.items():
    on = sorted(set(on))
    text += f"; pod {pod}'s work runs on pod{'s' * (len(on) > 1)} {','.join(map(str, on))}"
  return text
