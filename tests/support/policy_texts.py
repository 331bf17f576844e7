"""Policy documents shared by more than one test module."""

# Two errors at once (an inverted range and an undefined engine), so a caller
# can check that every error of a document is reported, each at its path.
INVALID_POLICY = """\
apiVersion: specgate/v1
name: broken
engines:
  base: {method: none}
rules:
  - name: r
    when: {route: [chat], batch_size: {min: 9, max: 2}}
    then: {engine: drfat}
default: {engine: base}
"""
