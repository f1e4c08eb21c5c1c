"""The log line of a drop or a rejoin: the pods, each one's cause, where it happened, the live
pods left, a drop's stall (from the last step that finished to the drop), the detection (a
drill's), the seconds of the drop or rejoin itself by cause, what runs again and where a hosted
pod's work runs. One line per event, as the operator reads it."""


def line(event: dict, parts: dict, hosts: dict) -> str:
  """`event`: kind ("drop" or "rejoin"), pods, cause, at ("at step N", "during ..."), live and
  num_pods (after it), stall_s (a drop's: from the last step that finished, or the first failed
  step's start if later, to the drop: the failed steps' first run and the detection), seconds
  (the drop or rejoin itself), detect_s (a drill's: from the kill to the drop, or None) and
  again (what runs again, or ""); `parts`: its seconds by cause; `hosts`: {hosted pod: the pods
  its work runs on} (podsets.py: nothing compiled)."""
  pods = ",".join(map(str, event["pods"]))
  verb = "lost" if event["kind"] == "drop" else "rejoined"
  text = f"pod {pods} {verb} ({event['cause']}) {event['at']}: "
  text += f"{event['live']} of {event['num_pods']} pods live; "
  if event.get("stall_s") is not None:
    text += f"stalled {event['stall_s']:.2f} s from the last step to the drop; "
  if event["detect_s"] is not None:
    text += f"found {event['detect_s']:.2f} s after the fault; "
  detail = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in parts.items())
  text += f"took {event['seconds']:.2f} s ({detail})"
  if event["again"]:
    text += f"; {event['again']}"
  for pod, on in hosts.items():
    on = sorted(set(on))
    text += f"; pod {pod}'s work runs on pod{'s' * (len(on) > 1)} {','.join(map(str, on))}"
  return text
