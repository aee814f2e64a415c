"""Where every value of a planned graph lives: the record `passes.plan_memory` fills and
codegen (and control-flow ops, for their bodies) read."""

from __future__ import annotations

from dataclasses import dataclass, field

from cuvil.compiler.ir import Dim, Node, Value


@dataclass(frozen=True)
class Storage:
    kind: str  # "input" | "output" | "weights" | "workspace" | "derived"
    index: int = 0  # input/output position
    offset: Dim = 0  # byte offset in the weights blob, the workspace or the derived buffer


@dataclass
class MemoryPlan:
    storage: dict[Value, Storage] = field(default_factory=dict)
    weights: bytearray = field(default_factory=bytearray)
    workspace_size: Dim = 0
    #: graph outputs whose value lives elsewhere (an input, a constant, another output)
    output_copies: list[tuple[Value, int]] = field(default_factory=list)
    #: view nodes whose output shares the input's storage: no code
    elided: set[Node] = field(default_factory=set)
    #: workspace offset of the scratch memory a node asked for (`Op.scratch_bytes`)
    scratch: dict[Node, Dim] = field(default_factory=dict)
    #: byte offset of the weights a node derives from its constants at run time
    #: (`Op.derived_bytes`), in the library's one buffer of them (codegen/derived.py)
    derived: dict[Node, int] = field(default_factory=dict)
    derived_size: int = 0
    #: the buffer's first bytes, which every first run fills; past them are the weights of the
    #: nodes that derive theirs only on CPUs that need them (`Op.derived_on_demand`)
    derived_eager_size: int = 0
    #: byte offset in the weights blob of the derived weights the compiler computed instead
    #: (`Op.derived_value`): the library stores them, its first run derives nothing for the node
    stored: dict[Node, int] = field(default_factory=dict)
    #: nodes computed from constants alone, too large to fold into the library (the light
    #: ONNX models' ConstantOfShape weights): run once, at the first run, their outputs kept in
    #: the derived buffer (Storage kind "derived") instead of recomputed by every run
    hoisted: list[Node] = field(default_factory=list)
