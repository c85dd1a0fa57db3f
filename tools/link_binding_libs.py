"""Patch a copy of llama.cpp's top-level CMakeLists.txt so that llama-server links the Python binding's compiled
libllama and ggml (the same sources, compiled with the same flags by `make install`) instead of compiling them again:
the build then compiles only llama-server, its common library and libmtmd (tools/build_llama_server.sh runs this).

Usage: python tools/link_binding_libs.py <llama.cpp source folder> <folder of the binding's libllama.so and libggml*.so>
"""
import sys
from pathlib import Path

LIBS = ('ggml-base', 'ggml-cpu', 'ggml', 'llama')   # what llama-server links, lowest layer first

def imported_targets(libdir: Path) -> str:
    "CMake code declaring the binding's libraries as the targets llama.cpp's own build would have made."
    lines = ['# rag_lab: libllama and ggml are the Python binding\'s compiled libraries, imported instead of compiled',
             f'set(RAG_LAB_BINDING_LIBS "{libdir}")',
             f'foreach(lib {" ".join(LIBS)})',
             '    add_library(${lib} SHARED IMPORTED GLOBAL)',
             '    set_target_properties(${lib} PROPERTIES IMPORTED_LOCATION "${RAG_LAB_BINDING_LIBS}/lib${lib}.so")',
             'endforeach()',
             # the usage requirements llama.cpp's own targets declare PUBLIC (ggml/src and src CMakeLists.txt)
             'set_target_properties(ggml-base PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${CMAKE_CURRENT_SOURCE_DIR}/ggml/include"',
             '                      INTERFACE_COMPILE_DEFINITIONS GGML_SHARED)',
             'set_target_properties(ggml PROPERTIES INTERFACE_LINK_LIBRARIES "ggml-base;ggml-cpu"',
             '                      INTERFACE_COMPILE_DEFINITIONS "GGML_SHARED;GGML_USE_CPU")',
             'set_target_properties(llama PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${CMAKE_CURRENT_SOURCE_DIR}/include"',
             '                      INTERFACE_LINK_LIBRARIES ggml INTERFACE_COMPILE_DEFINITIONS LLAMA_SHARED)', '']
    return '\n'.join(lines)

def patch(src: Path, libdir: Path) -> None:
    "Import the libraries before llama.cpp's ggml block (which then skips its own ggml), drop its libllama and install rules."
    missing = [f'lib{l}.so' for l in LIBS if not (libdir / f'lib{l}.so').exists()]
    if missing: sys.exit(f"{libdir}: the binding's libraries {missing} are missing (is llama-cpp-python installed?)")
    cm = src / 'CMakeLists.txt'
    text = cm.read_text()
    ggml_block, own_llama, install = 'if (LLAMA_USE_SYSTEM_GGML)\n', 'add_subdirectory(src)\n', '#\n# install\n#\n'
    unexpected = [m for m in (ggml_block, own_llama, install) if text.count(m) != 1]
    if unexpected: sys.exit(f"{cm}: not the layout this patch knows (each once): {unexpected!r}")
    text = text.replace(ggml_block, imported_targets(libdir) + ggml_block).replace(own_llama, '')
    cm.write_text(text[:text.index(install)])   # the install rules name llama, which is imported here

if __name__ == '__main__':
    if len(sys.argv) != 3: sys.exit(__doc__)
    patch(Path(sys.argv[1]), Path(sys.argv[2]).resolve())
