# Conan 2 recipe for fsdpx, a header-only C++20 library.
#
#   conan profile detect                                              (once: a default profile)
#   conan config install conan/profiles --target-folder profiles     (once: the profile fsdpx-system)
#   conan create . -pr:a fsdpx-system --build=missing --no-remote     (tools/conan_create.sh does all this)
#
# LibTorch, MPI and Boost are declared as requirements but are meant to come from the system: the
# profile conan/profiles/fsdpx-system lists them under [platform_requires], so Conan neither downloads nor
# builds them, and CMake finds them where they are installed. LibTorch: Torch_DIR (the environment or
# the conf user.fsdpx:torch_dir), else the torch package of the Python on PATH; the package records
# where it was, so a consumer on the same machine finds it without being told.
import os
import re
import shutil
import subprocess

from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import load
from conan.tools.scm import Version

required_conan_version = ">=2.0"


class FsdpxConan(ConanFile):
    name = "fsdpx"
    description = "Fully Sharded Data Parallel training for LibTorch (header-only C++20)"
    license = "Apache-2.0"
    topics = ("pytorch", "libtorch", "fsdp", "distributed", "mpi", "header-only")
    package_type = "header-library"
    # Settings only drive the CMake run that installs the headers and the CMake package; package_id()
    # clears them: one package serves every compiler, architecture and build type.
    settings = "os", "arch", "compiler", "build_type"
    exports_sources = "CMakeLists.txt", "LICENSE", "cmake/*", "include/*"
    no_copy_source = True

    def set_version(self):
        cmakelists = load(self, os.path.join(self.recipe_folder, "CMakeLists.txt"))
        self.version = re.search(r"project\(fsdpx\s+VERSION\s+([0-9.]+)", cmakelists).group(1)

    # Only Boost's headers are used (Asio): a Boost built by Conan needs none of its libraries.
    default_options = {"boost/*:header_only": True}

    def requirements(self):
        # The package is built with the MPI backend, Boost and OpenSSL, so these are always needed. The NCCL
        # backend is off in the Conan package (see generate()); install with CMake for GPU ranks.
        # transitive_headers: a consumer compiles fsdpx's headers, which include theirs.
        self.requires("libtorch/[>=2.0 <3]", transitive_headers=True)
        self.requires("nlohmann_json/[>=3.10 <4]", transitive_headers=True)  # commit records, safetensors, configs
        self.requires("openmpi/[>=4.1 <6]", transitive_headers=True)
        self.requires("boost/[>=1.74 <2]", transitive_headers=True)
        self.requires("openssl/[>=1.1.1 <4]", transitive_headers=True)  # the sync service's HMAC handshake and TLS
        self.requires("zlib/[>=1.2.11 <2]", transitive_headers=True)  # weight sync's XOR-and-compress deltas

    # C++20 as fsdpx uses it (concepts, designated initializers, std::erase_if, <bit>): the oldest
    # compilers known to build it.
    _minimum_compilers = {"gcc": "11", "clang": "14", "apple-clang": "14"}

    def validate(self):
        if self.settings.get_safe("compiler.cppstd"):
            check_min_cppstd(self, 20)
        compiler, version = self.settings.get_safe("compiler"), self.settings.get_safe("compiler.version")
        minimum = self._minimum_compilers.get(str(compiler))
        if minimum and version and Version(version) < minimum:
            raise ConanInvalidConfiguration(f"fsdpx needs {compiler} {minimum} or newer for C++20; this is {compiler} {version}")
        if compiler and str(compiler) not in self._minimum_compilers:
            raise ConanInvalidConfiguration(f"fsdpx is built and tested with GCC and Clang on Linux; {compiler} is not supported")

    def layout(self):
        cmake_layout(self)

    def generate(self):
        # No CMakeDeps: the dependencies are the system's, found by their own CMake configs/modules.
        tc = CMakeToolchain(self)
        # Headers and the CMake package only: every FSDPX_BUILD_* option (tests, examples, benchmarks,
        # tools, ...) OFF, whichever the project has; their directories are not exported either.
        cmakelists = load(self, os.path.join(self.source_folder, "CMakeLists.txt"))
        for option in re.findall(r"option\((FSDPX_BUILD_\w+)", cmakelists):
            tc.cache_variables[option] = False
        # Fixed backends, so the package's contents do not depend on the machine it was created on
        # (its package_id is cleared below).
        tc.cache_variables["FSDPX_WITH_MPI"] = True
        tc.cache_variables["FSDPX_WITH_BOOST"] = True
        tc.cache_variables["FSDPX_WITH_OPENSSL"] = True
        tc.cache_variables["FSDPX_WITH_ZLIB"] = True
        tc.cache_variables["FSDPX_WITH_NCCL"] = False
        tc.cache_variables["Torch_DIR"] = self._torch_dir()
        tc.generate()

    def _torch_dir(self):
        """LibTorch's CMake package: Torch_DIR, the conf user.fsdpx:torch_dir, or the Python on PATH's torch."""
        found = self.conf.get("user.fsdpx:torch_dir", default=None, check_type=str) or os.environ.get("Torch_DIR")
        if not found:
            for python in ("python3", "python"):
                exe = shutil.which(python)
                if not exe:
                    continue
                p = subprocess.run([exe, "-c", "import torch; print(torch.utils.cmake_prefix_path)"],
                                   capture_output=True, text=True)
                if p.returncode == 0 and p.stdout.strip():
                    found = os.path.join(p.stdout.strip(), "Torch")
                    break
        if not found or not os.path.exists(os.path.join(found, "TorchConfig.cmake")):
            raise ConanInvalidConfiguration(
                "fsdpx needs LibTorch: set Torch_DIR to <libtorch>/share/cmake/Torch (or -c user.fsdpx:torch_dir=...), "
                "or put a Python with torch on PATH" + (f"; {found} holds no TorchConfig.cmake" if found else ""))
        return found

    def build(self):
        # Nothing is compiled; configuring generates fsdpxConfig.cmake and fsdpxTargets.cmake.
        cmake = CMake(self)
        cmake.configure()

    def package(self):
        cmake = CMake(self)
        cmake.install()

    def package_id(self):
        self.info.clear()

    def package_info(self):
        # Consumers use the project's own CMake package (lib/cmake/fsdpx/fsdpxConfig.cmake), not one
        # generated by CMakeDeps: it find_dependency()s Torch, MPI and Boost through their own configs
        # and gives fsdpx::fsdpx the real targets (torch, MPI::MPI_CXX, Boost::headers) and the
        # FSDPX_WITH_* definitions. CMakeDeps could not do that here, because platform requirements
        # have no Conan package and hence no CMake targets of their own. So CMakeDeps generates
        # nothing for fsdpx, and builddirs puts the package on CMAKE_PREFIX_PATH (CMakeToolchain) for
        # find_package(fsdpx CONFIG).
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.set_property("cmake_file_name", "fsdpx")
        self.cpp_info.set_property("cmake_target_name", "fsdpx::fsdpx")
        self.cpp_info.builddirs = [os.path.join("lib", "cmake", "fsdpx")]
        self.cpp_info.includedirs = ["include"]
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.defines = ["FSDPX_WITH_MPI=1", "FSDPX_WITH_BOOST=1", "FSDPX_WITH_SYNC_SERVICE=1", "FSDPX_WITH_ZLIB=1"]  # for non-CMake generators
