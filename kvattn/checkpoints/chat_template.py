"""Chat templates from checkpoints, rendered as transformers renders them, under a budget.

A chat template is code that arrives inside a checkpoint. jinja2's immutable sandbox,
configured as transformers configures it (`trim_blocks`, `lstrip_blocks`,
`raise_exception`, a `tojson` that does not escape HTML), keeps it away from the system, so
the prompt text equals `tokenizer.apply_chat_template(messages, tokenize=False)`'s; but the
sandbox does not stop it looping or allocating without bound, so each render also runs
under budgets (`TEMPLATE_MAX_STEPS`, `TEMPLATE_MAX_CHARS`, `TEMPLATE_WORK_FACTOR`,
`TEMPLATE_MAX_DIGITS`; docs/hardening.md says why these values): a render that exceeds one
stops with a `ChatTemplateBudgetError` (a ValueError) naming the template's file and the
limit, before the allocation wherever its size can be foreseen from the arguments.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import json
import math
import re
import string
import sys
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence


# Budgets of one chat-template render (docs/hardening.md: how they were chosen).
# Steps: loop iterations, each weighted by the number of template nodes in the loop body, plus
# calls, filters, tests and operators; about 1 us of jinja2 each.
TEMPLATE_MAX_STEPS = 1_000_000
# Characters of the rendered prompt, and of any one string or list the template builds (items
# and characters, counted through nesting), plus twice the characters of the messages and
# keyword arguments passed in, so a long conversation is never cut short by its own length.
TEMPLATE_MAX_CHARS = 1_000_000
# Characters and items built or scanned in one render, in all, in units of the limit above:
# bounds quadratic patterns (a string grown by appends) that stay under the per-value limit.
TEMPLATE_WORK_FACTOR = 16
# Decimal digits of an integer a template computes (Python's own int <-> str limit).
TEMPLATE_MAX_DIGITS = 4300


class ChatTemplateBudgetError(ValueError):
  """A chat template exceeded a render budget (the message names its file and the limit)."""


# ------------------------------------------------------------------------------------------------
# Chat templates: jinja2's immutable sandbox, charged to a budget per render.
#
# jinja2's documented hooks do the charging: `intercepted_binops` + `call_binop` (operators),
# `call` (every call a sandboxed template makes: functions, methods, macros, `loop(...)`),
# `finalize` (every `{{ ... }}`), the filters and tests (wrapped), `range` (replaced), and the
# template's AST (`Environment.parse`, `nodes.EnvironmentAttribute`, `NodeTransformer`), in
# which every `for` loop's iterable, every `~` concatenation, every slice and every operand of
# a comparison is wrapped in a call to the environment. Sizes are checked before a
# value is built wherever its size follows from the arguments (`'x' * n`, `s.ljust(n)`,
# `sep.join(items)`, ...), and after, for everything else. Work that is linear in a value's
# size (a comparison, `s.find(...)`, a filter walking a list) charges that size to the total.

_ACTIVE_BUDGET: contextvars.ContextVar["_RenderBudget | None"] = contextvars.ContextVar(
    "kvattn_chat_template_budget", default=None)
_CONTAINERS = (list, tuple, set, frozenset, dict)


class _RenderBudget:
  """What one render may still spend; every hook charges it and raises ValueError when spent."""

  def __init__(self, source: str, input_chars: int):
    self.source = source
    self.max_chars = TEMPLATE_MAX_CHARS + 2 * input_chars
    self.max_work = TEMPLATE_WORK_FACTOR * self.max_chars
    self.steps = self.work = self.output = 0
    self.chars_name = (f"kvattn.checkpoints.tokenizer.TEMPLATE_MAX_CHARS + twice the {input_chars:,} "
                       "characters passed in")

  def fail(self, what: str, limit: int, name: str):
    raise ChatTemplateBudgetError(f"chat template of {self.source}: {what}, over the limit of "
                                  f"{limit:,} per render ({name})")

  def step(self, weight: int = 1) -> None:
    self.steps += weight
    if self.steps > TEMPLATE_MAX_STEPS:
      self.fail("the render takes more steps (loop iterations weighted by the loop body's size, "
                "calls, filters, tests, operators)", TEMPLATE_MAX_STEPS,
                "kvattn.checkpoints.tokenizer.TEMPLATE_MAX_STEPS")

  def expect(self, size: int | float, what: str) -> None:
    """Refuses to build a value estimated at `size` characters or items."""
    if size > self.max_chars:
      self.fail(f"{what} would build {size:,.0f} characters or items", self.max_chars,
                self.chars_name)

  def digits(self, digits: int | float, what: str) -> None:
    if digits > TEMPLATE_MAX_DIGITS:
      self.fail(f"{what} would build an integer of ~{digits:,.0f} digits", TEMPLATE_MAX_DIGITS,
                "kvattn.checkpoints.tokenizer.TEMPLATE_MAX_DIGITS")

  def charge(self, work: int) -> None:
    self.work += work
    if self.work > self.max_work:
      self.fail("the strings and lists built or scanned add up to more characters and items",
                self.max_work, "kvattn.checkpoints.tokenizer.TEMPLATE_WORK_FACTOR x the per-value limit")

  def measure(self, value: Any, what: str) -> int:
    """`_measure(value)`, charged to the total (measuring costs about what it counts); `what`
    ("filter x reads") is about to walk `value`, so it must be within the per-value limit."""
    size = _measure(value, self.max_chars)
    if size > self.max_chars:
      self.fail(f"{what} more characters or items", self.max_chars, self.chars_name)
    self.charge(size)
    return size

  def value(self, value: Any, what: str) -> Any:
    """`value`, once its size is within the limit and charged to the total."""
    if isinstance(value, int) and not isinstance(value, bool):
      self.digits(_digits(value), what)
    self.measure(value, f"{what} built")
    return value

  def emit(self, piece: str) -> None:
    self.output += len(piece)
    if self.output > self.max_chars:
      self.fail("the rendered text is longer", self.max_chars, self.chars_name)


def _active_budget() -> _RenderBudget:
  budget = _ACTIVE_BUDGET.get()
  if budget is None:
    # jinja2 folds constant expressions while compiling; raising here leaves them to the render,
    # where they are charged like the rest.
    raise RuntimeError("chat-template hooks run only inside Tokenizer.apply_chat_template")
  return budget


def _measure(value: Any, limit: int) -> int:
  """About the length of `value` as text: string lengths, integer digits and one per container
  item, counted through nesting (a list holding one string k times counts it k times).

  Stops soon after the count passes `limit`, so its cost is bounded by what it may return.
  """
  if isinstance(value, (str, bytes)):
    return len(value)
  total, stack = 0, [value]
  while stack and total <= limit:
    v = stack.pop()
    if isinstance(v, (str, bytes)):
      total += len(v)
    elif isinstance(v, int):
      total += _digits(v)
    elif isinstance(v, _CONTAINERS):
      total += len(v)
      if total <= limit:
        stack.extend(itertools.chain.from_iterable(v.items()) if isinstance(v, dict) else v)
  return total


def _shallow(value: Any) -> int:
  """The length of a string or container (O(1)), else 0."""
  return len(value) if isinstance(value, (str, bytes, *_CONTAINERS)) else 0


def _depth(value: Any) -> int:
  """Nesting depth of the containers in `value` (0 for a scalar)."""
  deepest, stack = 0, [(value, 0)]
  while stack:
    v, d = stack.pop()
    if isinstance(v, _CONTAINERS):
      deepest = max(deepest, d + 1)
      stack.extend((x, d + 1) for x in (itertools.chain.from_iterable(v.items())
                                        if isinstance(v, dict) else v))
  return deepest


def _digits(n: int) -> int:
  return int(abs(n).bit_length() * math.log10(2)) + 1


def _estimate(fn: Callable[..., int | None], *args: Any) -> int | None:
  """`fn(*args)`, or None when the arguments are of the wrong kind: the call itself then raises
  its own error."""
  try:
    return fn(*args)
  except ChatTemplateBudgetError:
    raise
  except (TypeError, ValueError, AttributeError, OverflowError, KeyError, IndexError):
    return None


def _width(n: str) -> int:
  return int(n) if len(n) <= 18 else 10**18


_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?")


def _printf_size(fmt: str, values: Any, measure: Callable[[Any], int]) -> int:
  """Upper bound on `len(fmt % values)`: the format, its widths and precisions, the values."""
  values = values if isinstance(values, tuple) else (values,)
  star = max((v for v in values if isinstance(v, int)), default=0)
  size = len(fmt) + measure(values)
  for width, precision in _PRINTF_FIELD.findall(fmt):
    for n in (width, precision):
      size += star if n == "*" else _width(n) if n else 0
  return size


def _format_size(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any],
                 measure: Callable[[Any], int]) -> int:
  """Upper bound on `len(fmt.format(*args, **kwargs))`: widths and precisions of the format
  specs (nested `{}` specs: every integer argument), the arguments."""
  ints = [abs(v) for v in itertools.chain(args, kwargs.values()) if isinstance(v, int)]
  size = len(fmt) + measure([list(args), dict(kwargs)])
  for _, _, spec, _ in string.Formatter().parse(fmt):
    if spec:
      size += sum(_width(n) for n in re.findall(r"\d+", spec)) + (sum(ints) if "{" in spec else 0)
  return size


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], i: int, key: str,
         default: Any = None) -> Any:
  return args[i] if len(args) > i else kwargs.get(key, default)


def _replace_size(s: str | bytes, old: Any, new: Any, count: Any) -> int:
  hits = s.count(old) if old else len(s) + 1
  if count is not None and count >= 0:
    hits = min(hits, count)
  return len(s) + hits * len(new)


def _method_size(s: str | bytes, name: str, args: Sequence[Any], kwargs: Mapping[str, Any],
                 measure: Callable[[Any], int]) -> int | None:
  """Upper bound on the size of `s.<name>(*args, **kwargs)` for the str/bytes methods whose
  result can outgrow `s` and their arguments; None for the others."""
  arg = functools.partial(_arg, args, kwargs)
  if name in ("center", "ljust", "rjust", "zfill"):
    return max(len(s), arg(0, "width"))
  if name == "expandtabs":
    return len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(arg(0, "tabsize", 8), 0)
  if name == "replace":
    return _replace_size(s, arg(0, "old"), arg(1, "new"), arg(2, "count", -1))
  if name == "join":  # the items are a list by now (`call` materializes them)
    return measure(arg(0, "iterable")) + max(len(arg(0, "iterable")) - 1, 0) * len(s)
  if name == "translate":
    table = arg(0, "table")
    values = table.values() if isinstance(table, Mapping) else ()
    return len(s) * max([1, *(len(v) for v in values if isinstance(v, (str, bytes)))])
  if name == "format":
    return _format_size(s, args, kwargs, measure)
  if name == "format_map":
    return _format_size(s, (), arg(0, "mapping"), measure)
  return None


def _filter_size(name: str, value: Any, size: int, args: Sequence[Any],
                 kwargs: Mapping[str, Any], measure: Callable[[Any], int]) -> int | None:
  """Upper bound on the size of `value|name(*args, **kwargs)` (`value` measures `size`) for the
  builtin filters whose result can outgrow their arguments; None for the others."""
  arg = functools.partial(_arg, args, kwargs)
  if name == "center":
    return max(size, arg(0, "width", 80))
  if name == "indent":
    width = arg(0, "width", 4)
    width = len(width) if isinstance(width, str) else width
    return size + (str(value).count("\n") + 1) * max(width, 0)
  if name == "wordwrap":
    return size * (1 + len(arg(2, "wrapstring") or "\n")) + 1
  if name == "replace":
    return _replace_size(str(value), arg(0, "old"), arg(1, "new"), arg(2, "count"))
  if name == "format":
    return _printf_size(str(value), kwargs or tuple(args), measure)
  if name == "join":  # the items are a list by now (the wrapper materializes them)
    return size + max(len(value) - 1, 0) * len(str(arg(0, "d", "")))
  if name in ("batch", "slice"):
    return max(size, arg(0, "linecount" if name == "batch" else "slices"))
  if name == "tojson":  # an item per line, indented by its depth
    indent = arg(1, "indent")
    width = len(indent) if isinstance(indent, str) else indent or 0
    return 6 * size + size * width * _depth(value)
  return None


# Builtin filters that take O(1) time or return a lazy iterator (whose consumer is charged): their
# input is charged by its length, not walked (`messages|length` in a loop over messages stays
# linear in the conversation).
_SHALLOW_FILTERS = frozenset((
    "abs", "attr", "count", "d", "default", "filesizeformat", "first", "items", "last",
    "length", "map", "random", "reject", "rejectattr", "round", "safe", "select",
    "selectattr"))
# Builtin tests that compare their operands (the others take O(1) time).
_SCANNING_TESTS = frozenset((
    "in", "eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=", "gt",
    "greaterthan", ">", "ge", ">="))


def _budgeted_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
  """Filter `f`: one step, its input and arguments charged, its result's size checked before
  (`_filter_size`) and after."""
  measure_input = _shallow if name in _SHALLOW_FILTERS else None
  skip = 0 if getattr(f, "jinja_pass_arg", None) is None else 1  # a context argument first

  @functools.wraps(f)  # keeps jinja_pass_arg
  def budgeted(*args, **kwargs):
    budget = _active_budget()
    budget.step()
    if len(args) > skip:
      if name == "join":
        args = (*args[:skip], budget.value(list(args[skip]), "the items of join"),
                *args[skip + 1:])
      value, rest = args[skip], args[skip + 1:]
      if measure_input is None:
        size = budget.measure(value, f"filter {name} reads")
        budget.measure([list(rest), kwargs], f"the arguments of filter {name} have")
      else:
        size = measure_input(value)
        budget.charge(size)
      if name == "sum" and isinstance(value, (list, tuple)):  # sum(lists) copies as it adds
        budget.charge(len(value) * size // 2)
      size = _estimate(_filter_size, name, value, size, rest, kwargs,
                       functools.partial(budget.measure, what=f"filter {name} reads"))
      if size is not None:
        budget.expect(size, f"filter {name}")
    return budget.value(f(*args, **kwargs), f"filter {name}")

  return budgeted


def _budgeted_test(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
  """Test `f`: one step; a comparing test (`x is in(s)`, ...) charges its operands."""
  scans = name in _SCANNING_TESTS

  @functools.wraps(f)
  def budgeted(*args, **kwargs):
    budget = _active_budget()
    budget.step()
    if scans:
      budget.measure([list(args), kwargs], f"test {name} reads")
    return f(*args, **kwargs)

  return budgeted


def _budgeted_range(*args: int) -> range:
  """jinja2's sandboxed `range` (at most `jinja2.sandbox.MAX_RANGE` items), failing like the
  other budgets; loops over it are charged per iteration."""
  from jinja2 import sandbox  # pylint: disable=g-import-not-at-top
  r = range(*args)
  try:
    n = len(r)
  except OverflowError:
    n = sys.maxsize
  if n > sandbox.MAX_RANGE:
    _active_budget().fail(f"range() of {n:,} items", sandbox.MAX_RANGE,
                          "jinja2.sandbox.MAX_RANGE")
  return r


def _finalize(value: Any) -> Any:
  """jinja2's `finalize`: every `{{ ... }}` value, checked and charged, unchanged."""
  return _active_budget().value(value, "an output expression")


@functools.cache
def _jinja_classes():
  """`(environment class, AST instrumenter class)`; jinja2 is imported on first use."""
  # pylint: disable=g-import-not-at-top
  from jinja2 import nodes, sandbox, utils, visitor
  from jinja2.runtime import LoopContext, Macro

  def node_count(body: Iterable[Any]) -> int:
    return sum(1 + sum(1 for _ in n.find_all(nodes.Node)) for n in body)

  class Instrument(visitor.NodeTransformer):
    """Wraps every `for` iterable in `kvattn_loop(iterable, weight)`, every `~` and slice in
    `kvattn_built(value, what)` and every comparison operand in `kvattn_operand(value)`;
    records the largest recursive-loop and macro bodies."""

    def __init__(self):
      self.recursive_weight = self.call_weight = 1

    def hook(self, name, args, like):
      call = nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None)
      return call.set_lineno(like.lineno).set_environment(like.environment)

    def visit_For(self, node):  # pylint: disable=invalid-name
      weight = max(1, node_count([*node.body, *([node.test] if node.test else [])]))
      if node.recursive:
        self.recursive_weight = max(self.recursive_weight, weight)
      node = self.generic_visit(node)
      node.iter = self.hook("kvattn_loop", [node.iter, nodes.Const(weight)], node)
      return node

    def visit_Concat(self, node):  # pylint: disable=invalid-name
      return self.hook("kvattn_built", [self.generic_visit(node), nodes.Const("'~'")], node)

    def visit_Getitem(self, node):  # pylint: disable=invalid-name
      node = self.generic_visit(node)
      if isinstance(node.arg, nodes.Slice):  # compiled to a plain Python slice: a copy
        return self.hook("kvattn_built", [node, nodes.Const("a slice")], node)
      return node

    def visit_Compare(self, node):  # pylint: disable=invalid-name
      node = self.generic_visit(node)
      for holder in (node, *node.ops):
        if not isinstance(holder.expr, nodes.Const):
          holder.expr = self.hook("kvattn_operand", [holder.expr], holder.expr)
      return node

    def visit_Macro(self, node):  # pylint: disable=invalid-name
      self.call_weight = max(self.call_weight, node_count(node.body))
      return self.generic_visit(node)

    visit_CallBlock = visit_Macro  # its body is the `caller` macro

  class BudgetedSandbox(sandbox.ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox charging loops, calls and operators to the active budget."""

    intercepted_binops = frozenset(("+", "-", "*", "/", "//", "%", "**"))
    kvattn_recursive_weight = 1  # body size of the largest recursive loop
    kvattn_call_weight = 1  # body size of the largest macro

    def call_binop(self, context, operator, left, right):
      budget = _active_budget()
      budget.step()
      what = f"'{operator}'"
      if operator == "*":
        for seq, n in ((left, right), (right, left)):
          if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
            budget.expect(max(n, 0) * budget.measure(seq, f"{what} reads"), what)
            break
        else:
          if isinstance(left, int) and isinstance(right, int):
            budget.digits(_digits(left) + _digits(right), what)
      elif operator == "**" and isinstance(left, int) and isinstance(right, int):
        if right > 0 and abs(left) > 1:
          budget.digits(right * math.log10(abs(left)), what)
      elif operator == "%" and isinstance(left, (str, bytes)):
        size = _estimate(_printf_size, left, right,
                         functools.partial(budget.measure, what=f"{what} reads"))
        if size is not None:
          budget.expect(size, what)
      return budget.value(super().call_binop(context, operator, left, right), what)

    def call(__self, __context, __obj, *args, **kwargs):  # pylint: disable=no-self-argument
      # jinja2 passes the loop's and block's variables along for pass_context callables.
      scope = {k: kwargs.pop(k) for k in ("_loop_vars", "_block_vars") if k in kwargs}
      if getattr(__obj, "__self__", None) is __self:  # kvattn_loop, ...: they charge themselves
        return __obj(*args, **kwargs)
      budget = _active_budget()
      budget.step(__self.kvattn_call_weight if isinstance(__obj, Macro) else 1)
      if isinstance(__obj, LoopContext) and args:  # `loop(children)` in a recursive loop
        args = (__self.kvattn_loop(args[0], __self.kvattn_recursive_weight), *args[1:])
      target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
      owner = getattr(target, "__self__", None)
      name = getattr(target, "__name__", None) or getattr(target, "name", "a callable")
      if isinstance(owner, (str, bytes)):  # str methods scan their receiver and arguments
        what = f"{type(owner).__name__}.{name}()"
        budget.charge(len(owner))
        if name == "join" and args:
          args = (budget.value(list(args[0]), "the items of join"), *args[1:])
        budget.measure([list(args), kwargs], f"{what} reads")
        size = _estimate(_method_size, owner, name, args, kwargs,
                         functools.partial(budget.measure, what=f"{what} reads"))
        if size is not None:
          budget.expect(size, what)
      else:  # macros, globals, container methods: arguments pass by reference
        budget.charge(_shallow(owner) + sum(map(_shallow, itertools.chain(args,
                                                                          kwargs.values()))))
      if target is utils.generate_lorem_ipsum:  # n paragraphs of up to `max` words
        n, most = _arg(args, kwargs, 0, "n", 5), _arg(args, kwargs, 3, "max", 100)
        size = _estimate(lambda: n * (max(most, 1) * 16 + 8))
        if size is not None:
          budget.expect(size, "lipsum()")
      return budget.value(super().call(__context, __obj, *args, **kwargs, **scope), f"{name}()")

    def kvattn_loop(self, iterable: Iterable[Any], weight: int) -> Iterator[Any]:
      """`iterable`, charging `weight` steps per item."""
      budget = _active_budget()
      for item in iterable:
        budget.step(weight)
        yield item

    def kvattn_built(self, value: Any, what: str) -> Any:
      budget = _active_budget()
      budget.step()
      return budget.value(value, what)

    def kvattn_operand(self, value: Any) -> Any:
      """A comparison's operand, its size charged (`==`, `in` scan it)."""
      _active_budget().measure(value, "a comparison reads")
      return value

  return BudgetedSandbox, Instrument


@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
  """The jinja2 template of `source`, in the sandbox transformers renders chat templates in,
  instrumented to charge the active `_RenderBudget` (render inside `_ACTIVE_BUDGET`)."""
  import jinja2  # pylint: disable=g-import-not-at-top
  from jinja2.ext import loopcontrols  # pylint: disable=g-import-not-at-top

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  sandbox_class, instrument_class = _jinja_classes()
  env = sandbox_class(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                      finalize=_finalize)
  env.filters["tojson"] = tojson
  env.filters.update({name: _budgeted_filter(name, f) for name, f in env.filters.items()})
  env.tests.update({name: _budgeted_test(name, f) for name, f in env.tests.items()})
  env.globals["raise_exception"] = raise_exception
  env.globals["range"] = _budgeted_range
  instrument = instrument_class()
  ast = instrument.visit(env.parse(source))
  env.kvattn_recursive_weight = instrument.recursive_weight
  env.kvattn_call_weight = instrument.call_weight
  return env.from_string(ast)


def render(template: str, source: str, **variables: Any) -> str:
  """`template` rendered with `variables`, in jinja2's immutable sandbox with transformers'
  settings and under this module's budgets.

  Args:
    template: the jinja2 source of a checkpoint's chat template.
    source: where it came from (a file), named by every budget error.
    **variables: what the template sees (`messages`, `add_generation_prompt`, `bos_token`,
      `eos_token`, ...); `TEMPLATE_MAX_CHARS` grows by twice their characters.

  Raises:
    ChatTemplateBudgetError: (a ValueError) a budget or Python's recursion limit is
      exceeded; the message names `source` and the limit.
    jinja2.TemplateError: the template rejects its input (`raise_exception(...)`).
  """
  compiled = _compile_template(template)
  try:
    input_chars = len(json.dumps(variables, ensure_ascii=False, default=str))
  except (TypeError, ValueError, RecursionError):  # e.g. a circular structure
    input_chars = 0
  budget = _RenderBudget(source, input_chars)
  token = _ACTIVE_BUDGET.set(budget)
  pieces = []
  try:
    for piece in compiled.generate(**variables):
      budget.emit(piece)
      pieces.append(piece)
  except RecursionError:
    raise ChatTemplateBudgetError(
        f"chat template of {budget.source}: calls nest deeper than Python's recursion limit "
        f"({sys.getrecursionlimit()})") from None
  finally:
    _ACTIVE_BUDGET.reset(token)
  return "".join(pieces)
