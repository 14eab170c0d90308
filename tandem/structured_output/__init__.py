"""Structured outputs (JSON schema, regex, choice, grammar) for the engine core.

``StructuredOutputManager`` compiles each request's constraint in a thread pool (cached by
constraint), keeps one matcher per request and fills the token bitmask of each step's
constrained requests; backends are xgrammar (default) and llguidance. Nothing here imports
torch or a grammar library until the first constrained request arrives.
"""
from tandem.structured_output.backend import GrammarCompileError, GrammarSpec, create_backend
from tandem.structured_output.manager import PendingGrammarOutput, RequestGrammarState, StructuredOutputManager

__all__ = ["GrammarCompileError", "GrammarSpec", "PendingGrammarOutput", "RequestGrammarState",
           "StructuredOutputManager", "create_backend"]
