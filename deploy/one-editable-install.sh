# Sourced by the install scripts. An editable install writes mmpipe.egg-info
# in this tree, so two at once (.ci/run builds the engines' venvs while the
# main suite's install may run) take turns on a lock; without flock (not
# Linux) the command just runs.
one_editable_install() {  # command... (a function such as pip_quiet too)
  if command -v flock >/dev/null; then
    (flock 9 && "$@") 9>"${TMPDIR:-/tmp}/mmpipe-editable.lock"
  else
    "$@"
  fi
}
